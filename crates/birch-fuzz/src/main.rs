//! `birch-fuzz`: runs the fuzz targets (docs/TESTING.md, "Fuzzing").
//!
//! ```text
//! birch-fuzz list
//! birch-fuzz run [--seconds N] [--iterations N] [--seed N] [--hang-seconds N] [--save] [TARGET...]
//! birch-fuzz replay TARGET FILE|-...
//! ```
//!
//! `run` fuzzes each target (all by default) from its corpus for the budget, printing the
//! seed (replay with `--seed`, and the same `--iterations`); `--save` adds the inputs that
//! reached a new outcome class to `corpus/<target>/`. A panic or hang saves the input under
//! `crashes/<target>/` and exits non-zero. `replay` runs inputs (`-` is standard input, for
//! an external engine) and prints each one's outcome class.

use std::io::Read;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use birch_fuzz::runner::{corpus_dir, crashes_dir, fuzz, load_dir, run_one, save, Budget};
use birch_fuzz::{target, Target, TARGETS};

fn usage() -> ExitCode {
    eprintln!(
        "usage: birch-fuzz list\n       birch-fuzz run [--seconds N] [--iterations N] [--seed N] \
         [--hang-seconds N] [--save] [TARGET...]\n       birch-fuzz replay TARGET FILE|-..."
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("list") => {
            for t in TARGETS {
                println!("{}", t.name);
            }
            ExitCode::SUCCESS
        }
        Some("run") => run(&args[1..]),
        Some("replay") => replay(&args[1..]),
        _ => usage(),
    }
}

fn number(value: Option<&String>) -> Option<u64> {
    value.and_then(|v| v.parse().ok())
}

fn run(args: &[String]) -> ExitCode {
    let mut seconds = 10u64;
    let mut iterations = u64::MAX;
    let mut hang = 20u64;
    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let mut keep = false;
    let mut targets: Vec<Target> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let parsed = match arg.as_str() {
            "--seconds" => number(it.next()).map(|v| seconds = v),
            "--iterations" => number(it.next()).map(|v| iterations = v),
            "--seed" => number(it.next()).map(|v| seed = v),
            "--hang-seconds" => number(it.next()).map(|v| hang = v),
            "--save" => {
                keep = true;
                Some(())
            }
            name => target(name).map(|t| targets.push(t)),
        };
        if parsed.is_none() {
            eprintln!("birch-fuzz: bad argument {arg:?}");
            return usage();
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    println!("birch-fuzz: seed {seed} (replay: --seed {seed})");
    let budget = Budget {
        iterations,
        time: Duration::from_secs(seconds),
        hang: Duration::from_secs(hang),
    };
    let mut failed = false;
    for t in &targets {
        // The fixed crashes first: in this build's profile (overflow checks in `checked`),
        // which the corpus test in release cannot see.
        for (path, input) in load_dir(&crashes_dir(t.name)) {
            if let Err(message) = run_one(t, &input) {
                println!("{}: {}: PANIC again: {message}", t.name, path.display());
                failed = true;
            }
        }
        let pool: Vec<Vec<u8>> = load_dir(&corpus_dir(t.name))
            .into_iter()
            .map(|(_, bytes)| bytes)
            .collect();
        let corpus = pool.len();
        match fuzz(t, pool, seed, budget, true) {
            Ok(stats) => {
                let mut saved = 0;
                if keep {
                    for input in &stats.kept {
                        saved += usize::from(save(&corpus_dir(t.name), "", input).is_some());
                    }
                }
                let guided = stats
                    .coverage
                    .map(|(hit, all)| format!(", edges {hit} of {all}"))
                    .unwrap_or_default();
                println!(
                    "{:<18} {:>8} inputs in {:>5.1} s ({:>7.0}/s), corpus {corpus}, {} outcome \
                     classes{guided}, {} new inputs{}",
                    t.name,
                    stats.iterations,
                    stats.seconds,
                    stats.iterations as f64 / stats.seconds.max(1e-9),
                    stats.classes,
                    stats.kept.len(),
                    if keep {
                        format!(", {saved} saved to the corpus")
                    } else {
                        String::new()
                    }
                );
            }
            Err(crash) => {
                failed = true;
                println!(
                    "{}: PANIC: {}\n  input (hex): {}\n  saved: {}",
                    t.name,
                    crash.message,
                    birch_format::hex(&crash.input),
                    crash
                        .saved
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "not saved".into())
                );
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn replay(args: &[String]) -> ExitCode {
    let Some(t) = args.first().and_then(|name| target(name)) else {
        return usage();
    };
    let mut failed = false;
    for file in &args[1..] {
        let input = if file == "-" {
            let mut buf = Vec::new();
            if let Err(e) = std::io::stdin().read_to_end(&mut buf) {
                eprintln!("birch-fuzz: stdin: {e}");
                return ExitCode::FAILURE;
            }
            buf
        } else {
            match std::fs::read(file) {
                Ok(bytes) => bytes,
                Err(e) => {
                    eprintln!("birch-fuzz: {file}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        };
        match run_one(&t, &input) {
            Ok(class) => println!("{file}: {class}"),
            Err(message) => {
                println!("{file}: PANIC: {message}");
                failed = true;
            }
        }
    }
    if failed {
        // An external engine sees a crash as an abort.
        std::process::abort();
    }
    ExitCode::SUCCESS
}
