//! `birch stats MNT`: the live counters of a mount (the root's `trusted.birch.stats` xattr,
//! which the daemon answers) as a table, as rates per interval with `--watch` (like iostat),
//! or as JSON for scripts.
//!
//! Owns the reading of that xattr and every number derived from it (rates, hit rate, fills,
//! percentiles); the counters themselves are the core's (`birch_core::counters`). Sends no
//! control command and changes nothing on the mount.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use birch_core::counters::{LatencyValues, LATENCY_BUCKETS};
use serde_json::{json, Value};

use crate::fail;

/// The xattr the daemon answers on the mount's root.
const STATS_XATTR: &str = "trusted.birch.stats";
/// The histograms in the stats, by the name `birch stats` shows.
const HISTOGRAMS: [(&str, &str); 2] = [
    ("commit", "commit_latency_us_log2"),
    ("fsync", "fsync_latency_us_log2"),
];
/// Percentiles shown for each histogram.
const PERCENTILES: [f64; 3] = [50.0, 90.0, 99.0];
/// Rows between repeated headers in `--watch` (iostat repeats its header too).
const WATCH_HEADER_EVERY: u64 = 20;

/// One reading of the stats: counters and gauges by name, and the latency histograms.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Sample {
    pub(crate) values: BTreeMap<String, u64>,
    pub(crate) histograms: BTreeMap<String, LatencyValues>,
    /// Why the filesystem is read-only (`read_only_cause`), if it is.
    pub(crate) read_only_cause: Option<String>,
}

impl Sample {
    /// Parses the JSON the daemon returns: numbers, and arrays of bucket counts.
    pub(crate) fn parse(text: &str) -> Result<Sample, String> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| format!("stats are not JSON: {e}"))?;
        let Value::Object(map) = value else {
            return Err("stats are not a JSON object".into());
        };
        let mut snapshot = Sample::default();
        for (name, value) in map {
            match value {
                Value::Number(n) => {
                    let n = n
                        .as_u64()
                        .ok_or_else(|| format!("stats field {name}: {n} is not a count"))?;
                    snapshot.values.insert(name, n);
                }
                Value::Array(items) => {
                    if items.len() != LATENCY_BUCKETS {
                        return Err(format!(
                            "stats field {name}: {} buckets, expected {LATENCY_BUCKETS}",
                            items.len()
                        ));
                    }
                    let mut buckets = [0u64; LATENCY_BUCKETS];
                    for (slot, item) in buckets.iter_mut().zip(&items) {
                        *slot = item
                            .as_u64()
                            .ok_or_else(|| format!("stats field {name}: {item} is not a count"))?;
                    }
                    snapshot.histograms.insert(name, LatencyValues { buckets });
                }
                Value::String(text) if name == "read_only_cause" => {
                    snapshot.read_only_cause = Some(text);
                }
                // Fields of kinds this version does not know are left out, not fatal.
                _ => {}
            }
        }
        Ok(snapshot)
    }

    fn get(&self, name: &str) -> u64 {
        self.values.get(name).copied().unwrap_or(0)
    }

    fn histogram(&self, field: &str) -> LatencyValues {
        self.histograms.get(field).cloned().unwrap_or_default()
    }

    /// Node cache hits per lookup, if there were any lookups.
    pub(crate) fn cache_hit_rate(&self) -> Option<f64> {
        ratio(
            self.get("cache_hits"),
            self.get("cache_hits") + self.get("cache_misses"),
        )
    }
}

/// `part / whole`, or `None` when `whole` is 0.
fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

/// The value of xattr `name` of `path`, read whole: the value may grow between the size query
/// and the read (a counter gains a digit, a scrub status moves on), so ERANGE retries.
pub(crate) fn getxattr(path: &Path, name: &str) -> std::io::Result<Vec<u8>> {
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_string());
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| invalid("path contains a NUL byte"))?;
    let cname =
        std::ffi::CString::new(name).map_err(|_| invalid("xattr name contains a NUL byte"))?;
    for _ in 0..4 {
        // SAFETY: getxattr with valid NUL-terminated strings and no buffer (size query).
        let len =
            unsafe { libc::getxattr(cpath.as_ptr(), cname.as_ptr(), std::ptr::null_mut(), 0) };
        if len < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut buf = vec![0u8; len as usize + 1024];
        // SAFETY: getxattr writes at most buf.len() bytes into buf, which outlives the call.
        let got = unsafe {
            libc::getxattr(
                cpath.as_ptr(),
                cname.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ERANGE) {
                continue;
            }
            return Err(e);
        }
        buf.truncate(got as usize);
        return Ok(buf);
    }
    Err(std::io::Error::other(format!(
        "{name} kept growing while read"
    )))
}

/// Reads the stats of the mount at `mountpoint`.
pub(crate) fn read(mountpoint: &Path) -> Result<Sample, String> {
    let shown = mountpoint.display();
    let buf = getxattr(mountpoint, STATS_XATTR).map_err(|e| match e.raw_os_error() {
        Some(libc::ENODATA) | Some(libc::ENOTSUP) => {
            format!("{shown}: not the root of a birchfs mount (no {STATS_XATTR})")
        }
        Some(libc::EPERM) => format!("{shown}: reading {STATS_XATTR} needs root (CAP_SYS_ADMIN)"),
        _ => format!("{shown}: reading {STATS_XATTR}: {e}"),
    })?;
    let text = String::from_utf8(buf).map_err(|_| format!("{shown}: stats are not UTF-8"))?;
    Sample::parse(&text).map_err(|e| format!("{shown}: {e}"))
}

/// Bytes for people: 1023 B, 4.0 KiB, 1.5 GiB.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A latency bound for people: 127 µs, 8.2 ms, 1.3 s.
pub(crate) fn human_micros(micros: u64) -> String {
    if micros < 1000 {
        format!("{micros} µs")
    } else if micros < 1_000_000 {
        format!("{:.1} ms", micros as f64 / 1e3)
    } else {
        format!("{:.1} s", micros as f64 / 1e6)
    }
}

fn percent(fraction: Option<f64>) -> String {
    fraction.map_or_else(|| "-".into(), |f| format!("{:.1}%", f * 100.0))
}

/// "p50 ≤127 µs  p90 ≤255 µs  p99 ≤8.2 ms (N)" or "none yet".
fn latency_summary(values: &LatencyValues) -> String {
    if values.count() == 0 {
        return "none yet".into();
    }
    let mut out = String::new();
    for p in PERCENTILES {
        if let Some(bound) = values.percentile_micros(p) {
            let _ = write!(out, "p{p:.0} ≤{}  ", human_micros(bound));
        }
    }
    let _ = write!(out, "({} calls)", values.count());
    out
}

/// The table `birch stats MNT` prints.
pub(crate) fn render_table(mountpoint: &str, s: &Sample) -> String {
    let mut out = String::new();
    let size = s.get("size_bytes");
    let free = s.get("free_bytes");
    let log_size = s.get("log_size_bytes");
    let log_used = s.get("log_used_bytes");
    let _ = writeln!(out, "birchfs stats of {mountpoint}");
    if let Some(cause) = &s.read_only_cause {
        let _ = writeln!(out, "  {:<12} {cause}", "read-only");
    }
    let _ = writeln!(
        out,
        "  {:<12} {} available of {} ({})",
        "space",
        human_bytes(free),
        human_bytes(size),
        percent(ratio(free, size))
    );
    let _ = writeln!(
        out,
        "  {:<12} {} buffered, not yet written",
        "dirty",
        human_bytes(s.get("dirty_bytes"))
    );
    let _ = writeln!(
        out,
        "  {:<12} {} of {} in use ({})",
        "log",
        human_bytes(log_used),
        human_bytes(log_size),
        percent(ratio(log_used, log_size))
    );
    let _ = writeln!(
        out,
        "  {:<12} {} hit rate ({} hits, {} misses)",
        "node cache",
        percent(s.cache_hit_rate()),
        s.get("cache_hits"),
        s.get("cache_misses")
    );
    for (label, field) in HISTOGRAMS {
        let _ = writeln!(
            out,
            "  {:<12} {}",
            format!("{label} time"),
            latency_summary(&s.histogram(field))
        );
    }
    let _ = writeln!(out, "counters since mount:");
    let width = s.values.keys().map(String::len).max().unwrap_or(0);
    for (name, value) in &s.values {
        let _ = writeln!(out, "  {name:<width$} {value:>14}");
    }
    out
}

/// Rates over one interval of `--watch`: counters per second, gauges as read at its end, and
/// the percentiles of the calls made in it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Interval {
    pub(crate) secs: f64,
    /// Per-second rates of every counter (gauges left out).
    pub(crate) rates: BTreeMap<String, f64>,
    pub(crate) end: Sample,
    pub(crate) latencies: BTreeMap<String, LatencyValues>,
}

/// Gauges of the fault state (0 or 1), beside [`GAUGES`]; they have no rate either.
const FAULT_GAUGES: [&str; 1] = ["read_only_failure"];

/// Gauges: values that are levels, not counts, so they have no rate.
const GAUGES: [&str; 6] = [
    "dirty_bytes",
    "log_used_bytes",
    "log_size_bytes",
    "free_bytes",
    "size_bytes",
    "shared_bytes",
];

pub(crate) fn interval(start: &Sample, end: &Sample, secs: f64) -> Interval {
    let secs = if secs > 0.0 { secs } else { 1.0 };
    let rates = end
        .values
        .iter()
        .filter(|(name, _)| {
            !GAUGES.contains(&name.as_str()) && !FAULT_GAUGES.contains(&name.as_str())
        })
        .map(|(name, value)| {
            let before = start.values.get(name).copied().unwrap_or(0);
            (name.clone(), value.saturating_sub(before) as f64 / secs)
        })
        .collect();
    let latencies = HISTOGRAMS
        .iter()
        .map(|(label, field)| {
            (
                label.to_string(),
                end.histogram(field).since(&start.histogram(field)),
            )
        })
        .collect();
    Interval {
        secs,
        rates,
        end: end.clone(),
        latencies,
    }
}

impl Interval {
    fn rate(&self, name: &str) -> f64 {
        self.rates.get(name).copied().unwrap_or(0.0)
    }

    /// The node cache's hit rate over the interval.
    fn cache_hit_rate(&self) -> Option<f64> {
        let hits = self.rate("cache_hits");
        let all = hits + self.rate("cache_misses");
        (all > 0.0).then(|| hits / all)
    }

    fn p99(&self, label: &str) -> String {
        self.latencies
            .get(label)
            .and_then(|v| v.percentile_micros(99.0))
            .map_or_else(|| "-".into(), human_micros)
    }
}

/// The column header of `--watch`.
pub(crate) const WATCH_HEADER: &str = "  commit/s   fsync/s  log/s  wr MB/s  rd/s  flush/s  cache hit  dirty      log fill  free        commit p99  fsync p99";

/// One row of `--watch`.
pub(crate) fn render_row(i: &Interval) -> String {
    let e = &i.end;
    format!(
        "{:>10.1} {:>9.1} {:>6.1} {:>8.2} {:>5.0} {:>8.1} {:>10} {:<10} {:>8} {:<11} {:>11} {:>10}",
        i.rate("commits"),
        i.rate("fsyncs"),
        i.rate("log_batches"),
        i.rate("bytes_written") / 1e6,
        i.rate("device_reads"),
        i.rate("flushes"),
        percent(i.cache_hit_rate()),
        human_bytes(e.get("dirty_bytes")),
        percent(ratio(e.get("log_used_bytes"), e.get("log_size_bytes"))),
        human_bytes(e.get("free_bytes")),
        i.p99("commit"),
        i.p99("fsync"),
    )
}

/// Percentiles of a histogram as JSON: count, and p50/p90/p99 in µs (bucket upper bounds).
fn latency_json(values: &LatencyValues) -> Value {
    let mut out = serde_json::Map::new();
    out.insert("count".into(), json!(values.count()));
    for p in PERCENTILES {
        out.insert(format!("p{p:.0}_us"), json!(values.percentile_micros(p)));
    }
    Value::Object(out)
}

/// `birch stats --json MNT`: the counters, the gauges, and what the table derives from them.
pub(crate) fn sample_json(mountpoint: &str, s: &Sample) -> Value {
    let latencies: serde_json::Map<String, Value> = HISTOGRAMS
        .iter()
        .map(|(label, field)| {
            (
                format!("{label}_latency"),
                latency_json(&s.histogram(field)),
            )
        })
        .collect();
    json!({
        "mountpoint": mountpoint,
        "counters": s.values,
        "cache_hit_rate": s.cache_hit_rate(),
        "log_fill": ratio(s.get("log_used_bytes"), s.get("log_size_bytes")),
        "free_fraction": ratio(s.get("free_bytes"), s.get("size_bytes")),
        "latency": latencies,
        "read_only_cause": s.read_only_cause,
    })
}

/// A label value in the Prometheus text format: `\`, `"` and newlines escaped.
fn prometheus_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `birch stats --prometheus MNT`: the Prometheus text exposition format, as node_exporter's
/// textfile collector reads it (write it to a `.prom` file there, e.g. from a timer): every
/// counter as `birch_NAME_total` (type counter), every gauge as `birch_NAME` (type gauge), and
/// the commit and fsync latency percentiles as `birch_commit_latency_seconds{quantile="…"}`
/// (type gauge: the upper bound of the log2 bucket holding it, so within a factor of two),
/// each with the label `mountpoint`.
pub(crate) fn sample_prometheus(mountpoint: &str, s: &Sample) -> String {
    let label = format!("mountpoint=\"{}\"", prometheus_label(mountpoint));
    let mut out = String::new();
    for (name, value) in &s.values {
        let (metric, kind) =
            if GAUGES.contains(&name.as_str()) || FAULT_GAUGES.contains(&name.as_str()) {
                (format!("birch_{name}"), "gauge")
            } else {
                (format!("birch_{name}_total"), "counter")
            };
        let _ = writeln!(out, "# TYPE {metric} {kind}");
        let _ = writeln!(out, "{metric}{{{label}}} {value}");
    }
    for (label_name, field) in HISTOGRAMS {
        let values = s.histogram(field);
        let metric = format!("birch_{label_name}_latency_seconds");
        let _ = writeln!(out, "# TYPE {metric} gauge");
        for p in PERCENTILES {
            if let Some(bound) = values.percentile_micros(p) {
                let _ = writeln!(
                    out,
                    "{metric}{{{label},quantile=\"{}\"}} {}",
                    p / 100.0,
                    bound as f64 / 1e6
                );
            }
        }
        let _ = writeln!(out, "# TYPE {metric}_count counter");
        let _ = writeln!(out, "{metric}_count{{{label}}} {}", values.count());
    }
    out
}

/// `birch stats --json --watch`: one object per interval.
pub(crate) fn interval_json(mountpoint: &str, i: &Interval) -> Value {
    let latencies: serde_json::Map<String, Value> = i
        .latencies
        .iter()
        .map(|(label, values)| (format!("{label}_latency"), latency_json(values)))
        .collect();
    let gauges: BTreeMap<&str, u64> = GAUGES.iter().map(|g| (*g, i.end.get(g))).collect();
    json!({
        "mountpoint": mountpoint,
        "interval_secs": i.secs,
        "rates_per_sec": i.rates,
        "gauges": gauges,
        "cache_hit_rate": i.cache_hit_rate(),
        "latency": latencies,
    })
}

/// How `birch stats` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The table (or rows with `--watch`).
    Table,
    /// JSON.
    Json,
    /// The Prometheus text format (one reading; not with `--watch`).
    Prometheus,
}

/// `birch stats MNT [--watch [SECS]] [--count N] [--json | --prometheus]`.
pub fn stats_main(
    mountpoint: &Path,
    watch: Option<f64>,
    count: Option<u64>,
    format: Format,
) -> ExitCode {
    let json = format == Format::Json;
    let shown = mountpoint.display().to_string();
    let first = match read(mountpoint) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if format == Format::Prometheus {
        print!("{}", sample_prometheus(&shown, &first));
        return ExitCode::SUCCESS;
    }
    let Some(secs) = watch else {
        if json {
            println!("{}", sample_json(&shown, &first));
        } else {
            print!("{}", render_table(&shown, &first));
        }
        return ExitCode::SUCCESS;
    };
    if !(secs.is_finite() && secs > 0.0) {
        return fail(format!(
            "--watch {secs}: needs a positive number of seconds"
        ));
    }
    let mut previous = first;
    let mut taken = Instant::now();
    let mut rows = 0u64;
    while count.is_none_or(|n| rows < n) {
        std::thread::sleep(Duration::from_secs_f64(secs));
        let now = match read(mountpoint) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        let elapsed = taken.elapsed().as_secs_f64();
        taken = Instant::now();
        let i = interval(&previous, &now, elapsed);
        if json {
            println!("{}", interval_json(&shown, &i));
        } else {
            if rows % WATCH_HEADER_EVERY == 0 {
                println!("{WATCH_HEADER}");
            }
            println!("{}", render_row(&i));
        }
        previous = now;
        rows += 1;
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(commits: u64, hits: u64, misses: u64, fsync_buckets: &[(usize, u64)]) -> String {
        let mut fsync = [0u64; LATENCY_BUCKETS];
        for (i, n) in fsync_buckets {
            fsync[*i] = *n;
        }
        let list = |b: &[u64]| b.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
        format!(
            "{{\"commits\": {commits}, \"cache_hits\": {hits}, \"cache_misses\": {misses}, \
             \"bytes_written\": {}, \"dirty_bytes\": 8192, \"log_used_bytes\": 1048576, \
             \"log_size_bytes\": 4194304, \"free_bytes\": 536870912, \"size_bytes\": 1073741824, \
             \"commit_latency_us_log2\": [{}], \"fsync_latency_us_log2\": [{}], \
             \"fuse_dev_requests\": 5}}",
            commits * 1_000_000,
            list(&[0; LATENCY_BUCKETS]),
            list(&fsync)
        )
    }

    fn parsed(text: &str) -> Sample {
        match Sample::parse(text) {
            Ok(s) => s,
            Err(e) => panic!("{e}: {text}"),
        }
    }

    #[test]
    fn prometheus_output_types_counters_and_gauges_and_escapes_the_label() {
        let text = sample(3, 10, 0, &[(4, 9), (9, 1)]).replace(
            "\"fuse_dev_requests\": 5",
            "\"fuse_dev_requests\": 5, \"device_write_errors\": 2, \"read_only_failure\": 1",
        );
        let out = sample_prometheus("/mnt/a\"b", &parsed(&text));
        let label = "{mountpoint=\"/mnt/a\\\"b\"}";
        for line in [
            "# TYPE birch_commits_total counter".to_string(),
            format!("birch_commits_total{label} 3"),
            "# TYPE birch_device_write_errors_total counter".to_string(),
            format!("birch_device_write_errors_total{label} 2"),
            "# TYPE birch_read_only_failure gauge".to_string(),
            format!("birch_read_only_failure{label} 1"),
            "# TYPE birch_free_bytes gauge".to_string(),
            format!("birch_free_bytes{label} 536870912"),
            format!("birch_fsync_latency_seconds_count{label} 10"),
        ] {
            assert!(
                out.lines().any(|l| l == line),
                "{line:?} missing from:\n{out}"
            );
        }
        // p50 of 9 calls in bucket 4 (16..31 µs) and 1 in bucket 9: that bucket's top, 31 µs.
        assert!(
            out.contains(
                "birch_fsync_latency_seconds{mountpoint=\"/mnt/a\\\"b\",quantile=\"0.5\"} 0.000031"
            ),
            "{out}"
        );
        // Every sample line is NAME{LABELS} VALUE with a numeric value.
        for l in out.lines().filter(|l| !l.starts_with('#')) {
            let value = l.rsplit(' ').next().unwrap_or_default();
            assert!(value.parse::<f64>().is_ok(), "{l}");
        }
    }

    #[test]
    fn parses_counters_gauges_and_histograms() {
        let s = parsed(&sample(3, 99, 1, &[(6, 9), (12, 1)]));
        assert_eq!(s.values.get("commits"), Some(&3));
        assert_eq!(s.values.get("fuse_dev_requests"), Some(&5));
        assert_eq!(s.histogram("fsync_latency_us_log2").count(), 10);
        assert_eq!(s.cache_hit_rate(), Some(0.99));
        assert!(Sample::parse("[1]").is_err());
        assert!(Sample::parse("{\"x\": -1}").is_err());
        assert!(Sample::parse("{\"x\": [1, 2]}").is_err());
        assert!(Sample::parse("not json").is_err());
        assert_eq!(s.read_only_cause, None);
    }

    #[test]
    fn the_read_only_cause_is_read_and_shown() {
        let text = sample(3, 99, 1, &[(6, 9)]).replacen(
            '{',
            "{\"read_only_cause\": \"device error: the device did not answer a flush\", ",
            1,
        );
        let s = parsed(&text);
        let cause = "device error: the device did not answer a flush";
        assert_eq!(s.read_only_cause.as_deref(), Some(cause));
        assert!(render_table("/m", &s).contains("read-only    device error: the device"));
        assert_eq!(
            sample_json("/m", &s)["read_only_cause"],
            Value::String(cause.to_string())
        );
    }

    #[test]
    fn formats_bytes_and_latencies() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(4096), "4.0 KiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_micros(127), "127 µs");
        assert_eq!(human_micros(8191), "8.2 ms");
        assert_eq!(human_micros(2_500_000), "2.5 s");
    }

    #[test]
    fn table_shows_every_derived_line_and_counter() {
        let s = parsed(&sample(3, 99, 1, &[(6, 9), (12, 1)]));
        let table = render_table("/mnt/x", &s);
        assert!(
            table.contains("512.0 MiB available of 1.0 GiB (50.0%)"),
            "{table}"
        );
        assert!(table.contains("8.0 KiB buffered"), "{table}");
        assert!(
            table.contains("1.0 MiB of 4.0 MiB in use (25.0%)"),
            "{table}"
        );
        assert!(
            table.contains("99.0% hit rate (99 hits, 1 misses)"),
            "{table}"
        );
        assert!(
            table.contains("p50 ≤127 µs  p90 ≤127 µs  p99 ≤8.2 ms  (10 calls)"),
            "{table}"
        );
        assert!(table.contains("commit time  none yet"), "{table}");
        assert!(table.contains("fuse_dev_requests"), "{table}");
    }

    #[test]
    fn rates_are_per_second_and_latencies_per_interval() {
        let a = parsed(&sample(3, 100, 0, &[(6, 10)]));
        let b = parsed(&sample(13, 150, 50, &[(6, 10), (12, 4)]));
        let i = interval(&a, &b, 2.0);
        assert_eq!(i.rate("commits"), 5.0);
        assert_eq!(i.rate("bytes_written"), 5_000_000.0);
        assert!(!i.rates.contains_key("dirty_bytes"), "gauges have no rate");
        assert_eq!(i.cache_hit_rate(), Some(0.5));
        // Only the 4 fsyncs of the interval, all in the 4096..8191 µs bucket.
        assert_eq!(i.p99("fsync"), "8.2 ms");
        assert_eq!(i.p99("commit"), "-");
        let row = render_row(&i);
        assert_eq!(row.split_whitespace().next(), Some("5.0"), "{row}");
        assert!(row.contains("50.0%"), "{row}");
        // A counter that went backwards (a remount) is a rate of 0, not a wrap.
        assert_eq!(interval(&b, &a, 1.0).rate("commits"), 0.0);
    }

    #[test]
    fn json_has_counters_and_derived_fields() {
        let s = parsed(&sample(3, 99, 1, &[(6, 9), (12, 1)]));
        let v = sample_json("/mnt/x", &s);
        assert_eq!(v["counters"]["commits"], 3);
        assert_eq!(v["log_fill"], 0.25);
        assert_eq!(v["free_fraction"], 0.5);
        assert_eq!(v["latency"]["fsync_latency"]["count"], 10);
        assert_eq!(v["latency"]["fsync_latency"]["p99_us"], 8191);
        assert_eq!(v["latency"]["commit_latency"]["p50_us"], Value::Null);
        let w = interval_json("/mnt/x", &interval(&s, &s, 1.0));
        assert_eq!(w["rates_per_sec"]["commits"], 0.0);
        assert_eq!(w["gauges"]["dirty_bytes"], 8192);
    }
}
