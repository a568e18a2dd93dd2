// anchorkv: command-line tool of the anchorkv library.
//   anchorkv eval   fidelity, reach, ratio and timing of every method vs exact attention
//   anchorkv bench  compress / decode timings vs FullKV (CPU, and CUDA when available)
// Subcommands parse their own options (cxxopts) from the arguments after their name.
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "anchorkv/anchorkv.h"
#include "commands.hpp"
#include "common.hpp"

namespace {

void print_usage(std::FILE *stream) {
  std::fprintf(stream,
               "anchorkv %s: anchor-residual KV cache compression, command-line tool\n"
               "\n"
               "Usage: anchorkv <command> [OPTION...]\n"
               "\n"
               "Commands:\n"
               "  eval    Compare AnchorKV and the baselines at 5x/10x/20x against exact attention: ratio,\n"
               "          bytes, compress and decode time, attention-output fidelity on held-out queries\n"
               "          and needle reach. Synthetic LLM-like data by default, or --data FILE.safetensors\n"
               "  bench   Time compress and decode against FullKV (CPU; CUDA when available)\n"
               "\n"
               "Options:\n"
               "  -h, --help     Show this help (anchorkv <command> --help for a command's options)\n"
               "  --version      Print the tool's and the loaded library's versions\n"
               "\n"
               "Exit status: 0 success, 1 failure (library error, bad input file), 2 usage error,\n"
               "3 eval --check found a problem.\n",
               AKV_VERSION_STRING);
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    print_usage(stderr);
    return akvcli::kExitUsage;
  }
  const std::string command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") {
    print_usage(stdout);
    return akvcli::kExitOk;
  }
  if (command == "--version") {
    std::printf("anchorkv tool %s, library %s\n", AKV_VERSION_STRING, akv_version_string());
    return akvcli::kExitOk;
  }
  try {
    if (command == "eval") return akvcli::run_eval(argc - 1, argv + 1);
    if (command == "bench") return akvcli::run_bench(argc - 1, argv + 1);
    std::fprintf(stderr, "anchorkv: error: unknown command \"%s\"\n\n", command.c_str());
    print_usage(stderr);
    return akvcli::kExitUsage;
  } catch (const akvcli::CliError &error) {
    std::fprintf(stderr, "anchorkv: error: %s\n", error.what());
    return error.exit_code();
  } catch (const std::bad_alloc &) {
    std::fprintf(stderr, "anchorkv: error: out of memory\n");
    return akvcli::kExitFailure;
  } catch (const std::exception &error) {
    std::fprintf(stderr, "anchorkv: error: %s\n", error.what());
    return akvcli::kExitFailure;
  }
}
