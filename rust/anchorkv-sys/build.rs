//! Finds (or builds) libanchorkv and checks the FFI layout against the C header.
//!
//! Library: with the `build-from-source` feature, CMake (run as a process: this crate has no
//! dependencies, so no `cmake` crate) builds the repository's library into `OUT_DIR` and it is
//! linked statically, so nothing is needed at run time. Otherwise `ANCHORKV_LIB_DIR` (a
//! directory holding libanchorkv.so), else the `pkg-config` program. Header:
//! `ANCHORKV_INCLUDE_DIR`, else next to the library (`<lib>/../include`), pkg-config's `-I`,
//! or the repository's `include/` when building from the source tree.
//!
//! Layout: a small C program compiled against the header with the system C compiler (`CC`,
//! else `cc`) prints sizeof/offsetof/enum values; they are written to
//! `$OUT_DIR/layout_checks.rs`, which the crate's layout test includes.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every struct of the header with its fields, in declaration order.
const STRUCTS: &[(&str, &[&str])] = &[
    ("akv_allocator", &["alloc", "free", "user_data"]),
    ("akv_context_options", &["struct_size", "backend", "device", "num_threads", "allocator"]),
    ("akv_rope", &["style", "rotary_dim", "base", "inv_freq"]),
    (
        "akv_compress_options",
        &[
            "struct_size", "method", "retain_fraction", "window", "anchors", "scored_fraction",
            "pool_kernel", "pool_type", "residual_scale", "seed", "layer_index", "layer_count",
            "rope", "keys_post_rope", "softmax_scale", "storage_dtype", "adakv_alpha",
            "quant_bits", "quant_outliers", "pyramid_beta", "andpro_chunk", "sink_tokens",
            "fill_budget", "anchor_share", "guard_fraction", "coverage_rounds", "compact_after",
        ],
    ),
    ("akv_shape", &["seq_len", "num_kv_heads", "num_q_heads", "head_dim"]),
    (
        "akv_prefill",
        &[
            "struct_size", "shape", "dtype", "keys", "values", "queries", "positions",
            "kv_head_stride", "kv_token_stride", "q_head_stride", "q_token_stride",
        ],
    ),
    (
        "akv_cache_stats",
        &[
            "struct_size", "method", "shape", "storage_dtype", "window", "anchors",
            "appended_tokens", "append_capacity", "full_bytes", "budget_bytes", "base_bytes",
            "compressed_bytes", "appended_bytes", "allocated_bytes", "ratio", "key_residuals",
            "value_residuals", "compactions",
        ],
    ),
    ("akv_head_stats", &["kept_tokens", "anchors", "key_residuals", "value_residuals"]),
];

/// Every enum of the header with its enumerators.
const ENUMS: &[(&str, &[&str])] = &[
    (
        "akv_status",
        &[
            "AKV_OK", "AKV_ERR_INVALID_ARGUMENT", "AKV_ERR_UNSUPPORTED", "AKV_ERR_BUDGET",
            "AKV_ERR_NON_FINITE", "AKV_ERR_OUT_OF_MEMORY", "AKV_ERR_CORRUPT_DATA",
            "AKV_ERR_VERSION", "AKV_ERR_BACKEND_UNAVAILABLE", "AKV_ERR_BACKEND",
            "AKV_ERR_MISMATCH", "AKV_ERR_CAPACITY", "AKV_ERR_INTERNAL",
        ],
    ),
    ("akv_dtype", &["AKV_DTYPE_AUTO", "AKV_DTYPE_F32", "AKV_DTYPE_F16", "AKV_DTYPE_BF16"]),
    ("akv_backend", &["AKV_BACKEND_CPU", "AKV_BACKEND_CUDA"]),
    (
        "akv_method",
        &[
            "AKV_METHOD_FULLKV", "AKV_METHOD_ANCHORKV", "AKV_METHOD_SNAPKV",
            "AKV_METHOD_PYRAMIDKV", "AKV_METHOD_ADAKV", "AKV_METHOD_ANDPRO",
            "AKV_METHOD_QUANTIZED",
        ],
    ),
    ("akv_rope_style", &["AKV_ROPE_NONE", "AKV_ROPE_NEOX", "AKV_ROPE_GPTJ"]),
    ("akv_pool_type", &["AKV_POOL_AVG", "AKV_POOL_MAX"]),
    ("akv_residual_scale", &["AKV_SCALE_LEAST_SQUARES", "AKV_SCALE_RMS", "AKV_SCALE_ABSMAX"]),
];

const MACROS: &[&str] = &["AKV_VERSION_MAJOR", "AKV_VERSION_MINOR", "AKV_VERSION_PATCH", "AKV_VERSION_NUMBER"];

struct Found {
    lib_dirs: Vec<PathBuf>,
    include_dirs: Vec<PathBuf>,
}

fn main() {
    for var in [
        "ANCHORKV_LIB_DIR", "ANCHORKV_INCLUDE_DIR", "PKG_CONFIG", "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR", "PKG_CONFIG_SYSROOT_DIR", "CC", "CMAKE",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let found = if env::var_os("CARGO_FEATURE_BUILD_FROM_SOURCE").is_some() {
        build_from_source(&out_dir)
    } else {
        let found = find_library();
        println!("cargo:rustc-link-lib=dylib=anchorkv");
        found
    };
    for dir in &found.lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    // Metadata for dependents (DEP_ANCHORKV_LIB_DIR, DEP_ANCHORKV_INCLUDE).
    if let Some(dir) = found.lib_dirs.first() {
        println!("cargo:lib_dir={}", dir.display());
    }

    let header_dir = found
        .include_dirs
        .iter()
        .find(|dir| dir.join("anchorkv").join("anchorkv.h").is_file())
        .cloned();
    if let Some(dir) = &header_dir {
        println!("cargo:include={}", dir.display());
        println!("cargo:rerun-if-changed={}", dir.join("anchorkv").join("anchorkv.h").display());
    }

    let checks = match header_dir {
        None => failing_check("anchorkv/anchorkv.h was not found (set ANCHORKV_INCLUDE_DIR)"),
        Some(dir) if env::var("TARGET").ok() == env::var("HOST").ok() => {
            probe_layout(&dir, &out_dir).unwrap_or_else(|error| failing_check(&error))
        }
        Some(_) => failing_check("cross build: the layout probe runs only for the host"),
    };
    // One block expression: include!() takes a single expression.
    fs::write(out_dir.join("layout_checks.rs"), format!("{{\n{checks}}}\n")).expect("write layout_checks.rs");
}

fn find_library() -> Found {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let source_tree_include = manifest_dir.join("../../include");
    let mut include_dirs: Vec<PathBuf> = env::var_os("ANCHORKV_INCLUDE_DIR").map(PathBuf::from).into_iter().collect();

    if let Some(lib_dir) = env::var_os("ANCHORKV_LIB_DIR").map(PathBuf::from) {
        if !lib_dir.is_dir() {
            panic!("ANCHORKV_LIB_DIR={} is not a directory", lib_dir.display());
        }
        include_dirs.push(lib_dir.join("../include"));
        include_dirs.push(source_tree_include);
        return Found { lib_dirs: vec![lib_dir], include_dirs };
    }

    let pkg_config = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into());
    let query = |args: &[&str]| -> Result<String, String> {
        let output = Command::new(&pkg_config)
            .args(args)
            .output()
            .map_err(|error| format!("could not run {pkg_config}: {error}"))?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).trim().to_string());
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    };
    let minimum = format!("--atleast-version={}", env::var("CARGO_PKG_VERSION").unwrap());
    match query(&[minimum.as_str(), "anchorkv"])
        .and_then(|_| query(&["--libs-only-L", "anchorkv"]))
        .and_then(|libs| query(&["--cflags-only-I", "anchorkv"]).map(|cflags| (libs, cflags)))
    {
        Ok((libs, cflags)) => {
            let lib_dirs = flag_values(&libs, "-L");
            include_dirs.extend(flag_values(&cflags, "-I"));
            include_dirs.extend(["/usr/local/include", "/usr/include"].map(PathBuf::from));
            include_dirs.push(source_tree_include);
            Found { lib_dirs, include_dirs }
        }
        Err(error) => {
            // A plain message and exit status, not a panic: cargo shows this text as it is.
            let why = if error.is_empty() { "no anchorkv.pc on its search path".to_string() } else { error };
            eprintln!(
                "\nlibanchorkv (>= {}) was not found ({pkg_config}: {why}). Either:\n  \
                 - build it with the crate: cargo build --features build-from-source (needs cmake and a C++17 \
                 compiler; links the library statically), or\n  \
                 - set ANCHORKV_LIB_DIR to the directory holding an installed libanchorkv.so, or\n  \
                 - set PKG_CONFIG_PATH to <prefix>/lib/pkgconfig of an installed library.\n",
                env::var("CARGO_PKG_VERSION").unwrap()
            );
            std::process::exit(1);
        }
    }
}

/// Builds the library of the enclosing repository with CMake (CPU backend) into `OUT_DIR`
/// and links its static archive, with what the archive itself needs: the C++ runtime and,
/// when CMake found it, OpenBLAS.
fn build_from_source(out_dir: &Path) -> Found {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let source = manifest_dir.join("../..");
    if !source.join("CMakeLists.txt").is_file() || !source.join("src").is_dir() {
        panic!("build-from-source: no anchorkv source tree at {}", source.display());
    }
    for input in ["CMakeLists.txt", "cmake", "include", "src"] {
        println!("cargo:rerun-if-changed={}", source.join(input).display());
    }
    let build = out_dir.join("cmake-build");
    let cmake = env::var("CMAKE").unwrap_or_else(|_| "cmake".into());
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "1".into());
    let run = |args: &[&std::ffi::OsStr]| {
        let status = Command::new(&cmake)
            .args(args)
            .status()
            .unwrap_or_else(|error| panic!("build-from-source: could not run {cmake}: {error}"));
        if !status.success() {
            panic!("build-from-source: {cmake} {args:?} failed ({status})");
        }
    };
    run(&[
        "-S".as_ref(),
        source.as_os_str(),
        "-B".as_ref(),
        build.as_os_str(),
        "-DCMAKE_BUILD_TYPE=Release".as_ref(),
        "-DANCHORKV_CUDA=OFF".as_ref(),
        "-DANCHORKV_BUILD_TESTS=OFF".as_ref(),
        "-DANCHORKV_BUILD_CLI=OFF".as_ref(),
        "-DANCHORKV_BUILD_SWIG=OFF".as_ref(),
    ]);
    // anchorkv_internal: the static archive of the same objects as libanchorkv.so.
    run(&["--build".as_ref(), build.as_os_str(), "--target".as_ref(), "anchorkv_internal".as_ref(),
          "--parallel".as_ref(), jobs.as_ref()]);

    println!("cargo:rustc-link-lib=static=anchorkv_internal");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    let cache = fs::read_to_string(build.join("CMakeCache.txt")).expect("read CMakeCache.txt");
    let cached = |key: &str| {
        cache.lines().find_map(|line| line.strip_prefix(key)?.split_once('=').map(|(_, value)| value.to_string()))
    };
    let mut lib_dirs = vec![build.join("src")];
    let blas = cached("ANCHORKV_CBLAS_LIBRARY:").filter(|path| !path.ends_with("NOTFOUND"));
    let blas_header = cached("ANCHORKV_CBLAS_INCLUDE:").filter(|path| !path.ends_with("NOTFOUND"));
    if let (Some(library), Some(_)) = (blas, blas_header) {
        // The same test as the CMake build's ANCHORKV_HAVE_BLAS: library and header found.
        let library = PathBuf::from(library);
        let name = library.file_stem().and_then(|stem| stem.to_str()).and_then(|stem| stem.strip_prefix("lib"));
        if let (Some(dir), Some(name)) = (library.parent(), name) {
            lib_dirs.push(dir.to_path_buf());
            println!("cargo:rustc-link-lib=dylib={name}");
        }
    }
    Found { lib_dirs, include_dirs: vec![source.join("include")] }
}

fn flag_values(flags: &str, prefix: &str) -> Vec<PathBuf> {
    flags.split_whitespace().filter_map(|flag| flag.strip_prefix(prefix)).map(PathBuf::from).collect()
}

/// Source of a test body that fails with `reason` (never a silent pass).
fn failing_check(reason: &str) -> String {
    println!("cargo:warning=anchorkv-sys layout probe unavailable: {reason}");
    format!("panic!(\"layout probe unavailable: {}\");\n", reason.escape_default())
}

fn probe_layout(include_dir: &Path, out_dir: &Path) -> Result<String, String> {
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <anchorkv/anchorkv.h>\nint main(void) {\n",
    );
    for (name, fields) in STRUCTS {
        writeln!(c, "printf(\"size {name} %zu\\n\", sizeof({name}));").unwrap();
        writeln!(c, "printf(\"align {name} %zu\\n\", _Alignof({name}));").unwrap();
        for field in *fields {
            writeln!(c, "printf(\"offset {name} {field} %zu\\n\", offsetof({name}, {field}));").unwrap();
        }
    }
    for (name, enumerators) in ENUMS {
        writeln!(c, "printf(\"size {name} %zu\\n\", sizeof({name}));").unwrap();
        for enumerator in *enumerators {
            writeln!(c, "printf(\"value {enumerator} %lld\\n\", (long long){enumerator});").unwrap();
        }
    }
    for name in MACROS {
        writeln!(c, "printf(\"value {name} %lld\\n\", (long long)({name}));").unwrap();
    }
    c.push_str("return 0;\n}\n");
    let source = out_dir.join("layout_probe.c");
    let binary = out_dir.join("layout_probe");
    fs::write(&source, c).map_err(|error| error.to_string())?;

    let compiler = env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiled = Command::new(&compiler)
        .arg("-std=c11")
        .arg("-I")
        .arg(include_dir)
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .map_err(|error| format!("could not run the C compiler {compiler}: {error}"))?;
    if !compiled.status.success() {
        return Err(format!("{compiler} failed: {}", String::from_utf8_lossy(&compiled.stderr)));
    }
    let ran = Command::new(&binary).output().map_err(|error| error.to_string())?;
    if !ran.status.success() {
        return Err("the layout probe failed to run".into());
    }

    let mut checks = String::new();
    for line in String::from_utf8_lossy(&ran.stdout).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["size", name, value] => writeln!(
                checks,
                "assert_eq!(::core::mem::size_of::<{name}>(), {value}, \"sizeof({name})\");"
            ),
            ["align", name, value] => writeln!(
                checks,
                "assert_eq!(::core::mem::align_of::<{name}>(), {value}, \"_Alignof({name})\");"
            ),
            ["offset", name, field, value] => writeln!(
                checks,
                "assert_eq!(::core::mem::offset_of!({name}, {field}), {value}, \"offsetof({name}, {field})\");"
            ),
            ["value", name, value] => {
                writeln!(checks, "assert_eq!({name} as i64, {value}i64, \"{name}\");")
            }
            _ => return Err(format!("unexpected probe output: {line}")),
        }
        .unwrap();
    }
    Ok(checks)
}
