// Entry points of the subcommands. argv[0] is the subcommand name; each returns an exit code
// or throws CliError.
#pragma once

namespace akvcli {

int run_eval(int argc, char **argv);
// `anchorkv eval --reach-grid`: needle reach over context lengths and depths (reach_grid.cpp).
int run_reach_grid(int argc, char **argv);
// `anchorkv eval --generate N`: a synthetic long generation with compaction (generate.cpp).
int run_generate(int argc, char **argv);
int run_bench(int argc, char **argv);

}  // namespace akvcli
