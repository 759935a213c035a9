//! UTC timestamps for reports and the policy's comment block, without a date library.

use std::time::{SystemTime, UNIX_EPOCH};

/// `YYYY-MM-DDTHH:MM:SSZ` for a time since the Unix epoch.
pub fn utc_string(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Now, as [`utc_string`].
pub fn now_utc() -> String {
    utc_string(SystemTime::now())
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Against `date -u -d @SECS` (GNU coreutils), which the test runs when present.
    #[test]
    fn matches_the_date_command() {
        for secs in [
            0u64,
            951_782_400,
            1_709_164_800,
            1_764_460_800,
            4_102_444_799,
        ] {
            let ours = utc_string(UNIX_EPOCH + Duration::from_secs(secs));
            let out = std::process::Command::new("date")
                .args(["-u", "-d", &format!("@{secs}"), "+%Y-%m-%dT%H:%M:%SZ"])
                .output()
                .expect("the date command (coreutils) is needed by this test");
            assert_eq!(ours, String::from_utf8_lossy(&out.stdout).trim(), "{secs}");
        }
    }
}
