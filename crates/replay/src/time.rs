//! Times on the command line and in the report, without a date crate: RFC 3339 (UTC or with an
//! offset), unix milliseconds, or a span before now (`24h`, `90m`, `7d`).

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `2024-05-01T12:00:00.250Z` for a unix ms.
pub fn format_ms(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s % 3600 / 60,
        s % 60,
        ms % 1000
    )
}

fn num(s: &str) -> Result<i64, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} is not a number"));
    }
    s.parse().map_err(|e| format!("{s:?}: {e}"))
}

fn rfc3339(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not an RFC 3339 time (like 2024-05-01T12:00:00Z)");
    let (date, rest) = s.split_at_checked(10).ok_or_else(bad)?;
    let sep = rest.chars().next().ok_or_else(bad)?;
    if !matches!(sep, 'T' | 't' | ' ') {
        return Err(bad());
    }
    let rest = &rest[1..];
    let mut dp = date.split('-');
    let (y, mo, d) = match (dp.next(), dp.next(), dp.next(), dp.next()) {
        (Some(y), Some(m), Some(d), None) if y.len() == 4 && m.len() == 2 && d.len() == 2 => {
            (num(y)?, num(m)?, num(d)?)
        }
        _ => return Err(bad()),
    };
    let zone_at = rest
        .find(['Z', 'z', '+', '-'])
        .ok_or_else(|| format!("{s:?} has no time zone (Z or ±HH:MM)"))?;
    let (clock, zone) = rest.split_at(zone_at);
    let (hms, frac) = clock.split_once('.').unwrap_or((clock, ""));
    let mut tp = hms.split(':');
    let (h, mi, sec) = match (tp.next(), tp.next(), tp.next(), tp.next()) {
        (Some(h), Some(m), Some(s), None) if h.len() == 2 && m.len() == 2 && s.len() == 2 => {
            (num(h)?, num(m)?, num(s)?)
        }
        _ => return Err(bad()),
    };
    let ms = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().chain("000".chars()).take(3).collect();
        num(frac)?;
        num(&digits)?
    };
    let offset_min = match zone {
        "Z" | "z" => 0,
        z => {
            let sign = if z.starts_with('-') { -1 } else { 1 };
            let (oh, om) = z[1..].split_once(':').ok_or_else(bad)?;
            sign * (num(oh)? * 60 + num(om)?)
        }
    };
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return Err(bad());
    }
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + sec - offset_min * 60;
    u64::try_from(secs * 1000 + ms).map_err(|_| format!("{s:?} is before 1970"))
}

/// A `--since` / `--until` value as unix ms.
pub fn parse_time(s: &str, now_ms: u64) -> Result<u64, String> {
    let s = s.trim();
    if let Some(unit) = s.chars().last().filter(|c| "smhd".contains(*c)) {
        if let Ok(n) = num(&s[..s.len() - 1]) {
            let per = match unit {
                's' => 1_000,
                'm' => 60_000,
                'h' => 3_600_000,
                _ => 86_400_000,
            };
            return Ok(now_ms.saturating_sub(n as u64 * per));
        }
    }
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map_err(|e| format!("{s:?}: {e}"));
    }
    rfc3339(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rfc3339_unix_ms_and_spans() {
        assert_eq!(parse_time("1970-01-01T00:00:00Z", 0), Ok(0));
        assert_eq!(
            parse_time("2024-02-29T12:30:15.25Z", 0),
            Ok(1_709_209_815_250)
        );
        assert_eq!(
            parse_time("2024-02-29T14:30:15.250+02:00", 0),
            Ok(1_709_209_815_250)
        );
        assert_eq!(parse_time("2024-02-29 12:30:15Z", 0), Ok(1_709_209_815_000));
        assert_eq!(parse_time("1709209815250", 0), Ok(1_709_209_815_250));
        assert_eq!(parse_time("24h", 100_000_000), Ok(100_000_000 - 86_400_000));
        assert_eq!(parse_time("90s", 100_000), Ok(10_000));
        assert!(parse_time("2024-02-29T12:30:15", 0).is_err(), "no zone");
        assert!(parse_time("yesterday", 0).is_err());
        assert!(parse_time("2024-13-01T00:00:00Z", 0).is_err());
    }

    #[test]
    fn formats_back() {
        assert_eq!(format_ms(1_709_209_815_250), "2024-02-29T12:30:15.250Z");
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        for ms in [0, 951_782_400_000, 1_709_209_815_250, 4_102_444_800_999] {
            assert_eq!(parse_time(&format_ms(ms), 0), Ok(ms));
        }
    }
}
