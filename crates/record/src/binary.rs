//! The replay inputs as the ledger stores them: a few dozen bytes instead of ~300 of packed JSON.
//!
//! PostgreSQL's cost of a ledger row grows with its bytes (heap, WAL and, on the bench machine,
//! a host fault for every new page-cache page they fill), and the packed JSON inputs were ~45 %
//! of a row (measured when it landed; see this file's git history). Here every struct is its
//! fields in declaration order, as in the packed JSON, but each enum is one byte (its position
//! in [`Code::all`]), the booleans and the presence of optional fields share flag bytes,
//! integers are LEB128 varints, and each float is a tag byte followed by nothing (`0.0`), a
//! varint (a whole number below 2^53) or its eight bytes: exact, NaN and `-0.0` included.
//!
//! The first byte is [`MARK`], which JSON text never starts with, so one `bytea` column holds
//! both these and the JSON text of rows written before migration 0004 ([`decode`] reads both).
//! Positional like the packed JSON: a change to the fields, or a code inserted anywhere but at
//! the end of its list, needs a new [`VERSION`](crate::inputs::VERSION).

use crate::inputs::{
    ActionKind, Code, Decided, Facts, PolicyInputs, PoolRead, RulesFingerprint, TierRead,
};

/// First byte of the binary form (never the first byte of JSON text).
pub const MARK: u8 = 0;

/// Appends `i` in the binary form.
pub fn encode(out: &mut Vec<u8>, i: &PolicyInputs) {
    out.extend_from_slice(&[MARK, i.v, code(i.mode)]);
    varint(out, i.sample_ms);
    varint(out, i.epoch_ms);
    let f = &i.facts;
    out.extend_from_slice(&[
        code(f.tier),
        flags(&[
            f.shapeable,
            f.fallback_available,
            f.spot_healthy,
            f.fallback_pool.is_some(),
            f.max_tokens.is_some(),
        ]),
    ]);
    if let Some(p) = f.fallback_pool {
        out.push(code(p));
    }
    out.extend_from_slice(&f.ticket.to_le_bytes());
    varint(out, f.prompt_tokens);
    if let Some(m) = f.max_tokens {
        varint(out, m);
    }
    f.inflight_work.iter().for_each(|&w| float(out, w));
    let t = &i.tier_state;
    out.extend_from_slice(&[
        code(t.state),
        code(t.driver),
        flags(&[t.fail_open, t.pressure_unavailable, i.fallback_active]),
    ]);
    for p in &i.pools {
        out.push(flags(&[
            p.pressure.is_some(),
            p.queue_depth.is_some(),
            p.sla_violation_rate.is_some(),
            p.work_limit.is_some(),
            p.saturated,
            p.busy,
            p.lend_limit.is_some(),
        ]));
        for v in [p.pressure, p.queue_depth, p.sla_violation_rate]
            .into_iter()
            .flatten()
        {
            float(out, v);
        }
        float(out, p.level);
        if let Some(w) = p.work_limit {
            float(out, w);
        }
        if let Some(w) = p.lend_limit {
            float(out, w);
        }
    }
    let r = &i.rules;
    for h in [r.tier, r.fallback, r.controller] {
        out.extend_from_slice(&h.to_le_bytes());
    }
    let d = &i.decided;
    out.extend_from_slice(&[code(d.action), u8::from(d.cap.is_some())]);
    if let Some(c) = d.cap {
        varint(out, u64::from(c));
    }
    out.extend_from_slice(&[code(d.reason), code(d.pool)]);
}

/// Reads inputs stored by the ledger: the binary form, or JSON text (packed or object form) from
/// before it. `None` for anything else — another version, truncated or trailing bytes — so the
/// row stays readable without them and replay counts it.
pub fn decode(b: &[u8]) -> Option<PolicyInputs> {
    if b.first() != Some(&MARK) {
        return serde_json::from_slice(b).ok();
    }
    let mut r = Reader(&b[1..]);
    let i = r.inputs()?;
    r.0.is_empty().then_some(i)
}

fn code<T: Code + PartialEq>(v: T) -> u8 {
    // Every list is far shorter than 256 (a test pins them).
    T::all().iter().position(|&c| c == v).unwrap_or(0) as u8
}

fn flags(bits: &[bool]) -> u8 {
    bits.iter()
        .enumerate()
        .fold(0, |acc, (n, &b)| acc | (u8::from(b) << n))
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

const FLOAT_ZERO: u8 = 0;
const FLOAT_WHOLE: u8 = 1;
const FLOAT_BITS: u8 = 2;
/// Whole numbers below this are exact as `f64` and as a varint.
const WHOLE_BELOW: f64 = 9_007_199_254_740_992.0;

/// Signals and levels are mostly zero or whole numbers (a KV percentage, a queue depth).
fn float(out: &mut Vec<u8>, v: f64) {
    if v.to_bits() == 0 {
        out.push(FLOAT_ZERO);
    } else if v > 0.0 && v < WHOLE_BELOW && v.fract() == 0.0 {
        out.push(FLOAT_WHOLE);
        varint(out, v as u64);
    } else {
        out.push(FLOAT_BITS);
        out.extend_from_slice(&v.to_bits().to_le_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f).checked_shl(shift)?;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn code<T: Code>(&mut self) -> Option<T> {
        T::all().get(usize::from(self.byte()?)).copied()
    }

    fn float(&mut self) -> Option<f64> {
        match self.byte()? {
            FLOAT_ZERO => Some(0.0),
            FLOAT_WHOLE => Some(self.varint()? as f64),
            FLOAT_BITS => Some(f64::from_bits(u64::from_le_bytes(self.array()?))),
            _ => None,
        }
    }

    fn flags<const N: usize>(&mut self) -> Option<[bool; N]> {
        let b = self.byte()?;
        Some(std::array::from_fn(|n| b & (1 << n) != 0))
    }

    fn opt_float(&mut self, present: bool) -> Option<Option<f64>> {
        if present {
            self.float().map(Some)
        } else {
            Some(None)
        }
    }

    fn inputs(&mut self) -> Option<PolicyInputs> {
        let v = self.byte()?;
        if !crate::inputs::readable(v) {
            return None;
        }
        let mode = self.code()?;
        let sample_ms = self.varint()?;
        let epoch_ms = self.varint()?;
        let tier = self.code()?;
        let [shapeable, fallback_available, spot_healthy, has_pool, has_max] = self.flags()?;
        let fallback_pool = if has_pool { Some(self.code()?) } else { None };
        let ticket = u64::from_le_bytes(self.array()?);
        let prompt_tokens = self.varint()?;
        let max_tokens = if has_max { Some(self.varint()?) } else { None };
        let inflight_work = [self.float()?, self.float()?];
        let state = self.code()?;
        let driver = self.code()?;
        let [fail_open, pressure_unavailable, fallback_active] = self.flags()?;
        let mut pools = [PoolRead::default(); 2];
        for p in &mut pools {
            let [has_p, has_q, has_s, has_w, saturated, busy, has_l] = self.flags()?;
            *p = PoolRead {
                pressure: self.opt_float(has_p)?,
                queue_depth: self.opt_float(has_q)?,
                sla_violation_rate: self.opt_float(has_s)?,
                level: self.float()?,
                work_limit: self.opt_float(has_w)?,
                saturated,
                busy,
                lend_limit: self.opt_float(has_l)?,
            };
        }
        let mut hash = || Some(u32::from_le_bytes(self.array()?));
        let rules = RulesFingerprint {
            tier: hash()?,
            fallback: hash()?,
            controller: hash()?,
        };
        let action: ActionKind = self.code()?;
        let cap = match self.byte()? {
            0 => None,
            1 => Some(u32::try_from(self.varint()?).ok()?),
            _ => return None,
        };
        Some(PolicyInputs {
            v,
            mode,
            sample_ms,
            epoch_ms,
            facts: Facts {
                tier,
                shapeable,
                fallback_available,
                spot_healthy,
                fallback_pool,
                ticket,
                prompt_tokens,
                max_tokens,
                inflight_work,
            },
            tier_state: TierRead {
                state,
                driver,
                fail_open,
                pressure_unavailable,
            },
            fallback_active,
            pools,
            rules,
            decided: Decided {
                action,
                cap,
                reason: self.code()?,
                pool: self.code()?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::tests::sample;
    use sluice_policy::{PolicyMode, Pool, PressureState, Reason, SignalKind, Tier};

    /// The position of `name` in `T`'s list.
    fn position<T: Code>(name: &str) -> Option<usize> {
        T::all().iter().position(|c| c.code() == name)
    }

    fn round_trip(i: &PolicyInputs) -> PolicyInputs {
        let mut out = Vec::new();
        encode(&mut out, i);
        decode(&out).unwrap_or_else(|| panic!("{out:?} did not decode"))
    }

    /// Bit for bit, the awkward floats included: a replayed decision must see what the policy saw.
    #[test]
    fn inputs_round_trip_exactly() {
        let (i, _) = sample();
        assert_eq!(round_trip(&i), i);
        let mut odd = i;
        odd.facts.inflight_work = [f64::NAN, -0.0];
        odd.facts.fallback_pool = None;
        odd.facts.max_tokens = None;
        odd.facts.ticket = 0;
        odd.pools[0] = PoolRead {
            pressure: Some(9_007_199_254_740_992.0),
            queue_depth: Some(-3.0),
            sla_violation_rate: Some(f64::INFINITY),
            level: 1e-300,
            saturated: true,
            work_limit: Some(4.0),
            busy: true,
            lend_limit: Some(2.5e3),
        };
        odd.pools[1] = PoolRead::default();
        odd.decided.cap = Some(u32::MAX);
        odd.sample_ms = u64::MAX;
        let back = round_trip(&odd);
        assert!(back.facts.inflight_work[0].is_nan());
        assert_eq!(back.facts.inflight_work[1].to_bits(), (-0.0f64).to_bits());
        let (mut a, mut b) = (back, odd);
        a.facts.inflight_work = [0.0; 2];
        b.facts.inflight_work = [0.0; 2];
        assert_eq!(a, b);
    }

    #[test]
    fn binary_is_a_fraction_of_the_packed_json() {
        let (i, _) = sample();
        let mut bin = Vec::new();
        encode(&mut bin, &i);
        let mut json = Vec::new();
        crate::line::write_inputs_packed(&mut json, &i);
        assert!(
            bin.len() * 3 < json.len(),
            "{} vs {}",
            bin.len(),
            json.len()
        );
    }

    /// Rows written before migration 0004 hold JSON text, packed or as an object.
    #[test]
    fn json_text_still_reads() {
        let (i, _) = sample();
        let mut packed = Vec::new();
        crate::line::write_inputs_packed(&mut packed, &i);
        assert_eq!(decode(&packed), Some(i));
        assert_eq!(decode(&serde_json::to_vec(&i).unwrap()), Some(i));
    }

    /// A version 1 record (before pools recorded `busy` and `lend_limit`) still reads: the same
    /// bytes, its pools not busy and without a lend limit.
    #[test]
    fn version_1_records_read_with_the_new_fields_at_their_defaults() {
        let (mut i, _) = sample();
        for p in &mut i.pools {
            p.busy = false;
            p.lend_limit = None;
        }
        let mut out = Vec::new();
        encode(&mut out, &i);
        out[1] = 1;
        let back = decode(&out).expect("a version 1 record");
        assert_eq!(back.v, 1);
        assert_eq!(back.pools, i.pools);
        let mut packed = Vec::new();
        i.v = 1;
        crate::line::write_inputs_packed(&mut packed, &i);
        // Version 1 packed its pools without the last two fields.
        let mut v1: serde_json::Value = serde_json::from_slice(&packed).unwrap();
        for pool in v1[7].as_array_mut().unwrap() {
            let fields = pool.as_array_mut().unwrap();
            assert_eq!(fields.len(), 8, "{fields:?}");
            fields.truncate(6);
        }
        let back: PolicyInputs = serde_json::from_value(v1).unwrap();
        assert_eq!(back.pools, i.pools);
    }

    /// Every strict prefix, a trailing byte, another version and a code past the list's end all
    /// read as "no inputs", never as other inputs.
    #[test]
    fn damaged_bytes_read_as_none() {
        let (i, _) = sample();
        let mut out = Vec::new();
        encode(&mut out, &i);
        for n in 0..out.len() {
            assert_eq!(decode(&out[..n]), None, "prefix of {n} bytes");
        }
        let mut longer = out.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None);
        let mut other = out.clone();
        other[1] = crate::inputs::VERSION + 1;
        assert_eq!(decode(&other), None);
        let mut bad_mode = out.clone();
        bad_mode[2] = 200;
        assert_eq!(decode(&bad_mode), None);
    }

    /// Stored rows hold these positions: a code may only be added at the end of its list.
    #[test]
    fn code_positions_are_pinned() {
        assert_eq!(position::<PolicyMode>("adaptive"), Some(1));
        assert_eq!(position::<Tier>("Best-Effort"), Some(2));
        assert_eq!(position::<Pool>("fallback"), Some(2));
        assert_eq!(position::<PressureState>("Critical"), Some(2));
        assert_eq!(position::<SignalKind>("sla_violation_rate"), Some(2));
        assert_eq!(position::<ActionKind>("reject"), Some(3));
        let reasons: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(reasons[..PINNED_REASONS.len()], PINNED_REASONS[..]);
        assert!(reasons.len() < 256);
    }

    /// `Reason::ALL` when the binary form was introduced, in order.
    const PINNED_REASONS: &[&str] = &[
        "below_tier_pressure_threshold",
        "endpoint_not_shapeable",
        "signals_unavailable_fail_open",
        "cache_pressure_unavailable_fail_open",
        "elevated_no_shaping_step",
        "body_not_json_forwarded",
        "degrade_pressure_elevated",
        "degrade_queue_depth_elevated",
        "degrade_sla_violation_rate_elevated",
        "fallback_sustained_pressure",
        "reject_pressure_critical",
        "reject_queue_depth_critical",
        "reject_sla_violation_rate_critical",
        "admitted_slo_headroom",
        "degrade_slo_headroom",
        "degrade_brownout",
        "degrade_cache_nearly_full",
        "fallback_slo_headroom",
        "reject_slo_headroom",
        "degrade_work_limit",
        "fallback_work_limit",
        "reject_work_limit",
        "reject_pressure_rail",
        "reject_queue_depth_rail",
        "demote_quota_exceeded",
        "reject_quota_exceeded",
        "tier_at_capacity",
        "queue_released",
        "queue_dropped",
        "queue_timed_out",
        "coordinator_unavailable_fail_open",
        "draining",
        "route_tier_pool",
        "route_spot_unhealthy_evicted",
        "route_spot_pressure_evicted",
        "route_fallback_backend",
        "unknown_tenant",
        "missing_api_key",
        "invalid_api_key",
        "invalid_tenant_header",
        "body_too_large",
        "invalid_json",
        "backend_unavailable",
        "upstream_error",
    ];
}
