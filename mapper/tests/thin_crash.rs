//! Crash consistency of a thin volume: random writes (partial and whole
//! blocks, FUA now and then) and flushes on a pool whose metadata and data
//! devices share one power supply, the power cut with writes in flight,
//! then a new pool over what survived. The metadata must open and pass
//! `thin_check` (where installed), and every sector must hold a version the
//! durability rule allows: what it held at the last completed FLUSH (or a
//! FUA write's data), or something written after it. Half the trials also
//! tear the writes the cut caught. A third run with `skip_block_zeroing`,
//! where every first write is provisioned on the reactor (a block's
//! sectors never made durable may then read as anything, as in dm).
//!
//! `UDM_THIN_CRASH_TRIALS=N` runs N trials (default 60); a failing seed is
//! printed.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::*;
use udm_backends::{Power, PowerCut, RamDevice};
use udm_core::{BioFlags, BlockDevice, Status};

/// 64 KiB blocks; a volume of 8 of them over a pool of 16.
const BS: u64 = 128;
const VOL: u64 = 8 * BS;
const META: u64 = 2048;

fn pc(name: &str, sectors: u64, power: &Arc<Power>) -> Arc<PowerCut> {
    let ram: Arc<dyn BlockDevice> =
        Arc::new(RamDevice::new(format!("{name}-ram"), sectors * 512).expect("ram"));
    Arc::new(
        PowerCut::new(name, ram, vec![0; (sectors * 512) as usize], power.clone()).expect("pc"),
    )
}

/// Which tag a sector holds (0 for zeroes), if it is one this test wrote.
fn tag_of(sector: u64, data: &[u8]) -> Option<u64> {
    if data.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let s = u64::from_le_bytes(data[..8].try_into().ok()?);
    let t = u64::from_le_bytes(data[8..16].try_into().ok()?);
    (s == sector && sector_pattern(t, s)[..] == data[..]).then_some(t)
}

fn thin_check(t: &Tester, meta: &Arc<dyn BlockDevice>) -> Result<(), String> {
    let Some(tool) = ["/usr/sbin/thin_check", "/sbin/thin_check"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        return Ok(());
    };
    let file = udm_core::testing::TempFile::new("thin-crash-meta");
    std::fs::write(&file.path, t.read(meta, 0, META)).map_err(|e| e.to_string())?;
    let out = std::process::Command::new(tool)
        .arg(&file.path)
        .output()
        .map_err(|e| e.to_string())?;
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.to_lowercase().contains("leak") {
        return Err(format!("thin_check: {text}"));
    }
    Ok(())
}

fn trial(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let power = Power::new();
    let meta = pc("meta", META, &power);
    let data = pc("data", 16 * BS, &power);
    let mut devs = Devices::new();
    devs.add(meta.clone());
    devs.add(data.clone());
    let skip = seed.is_multiple_of(3);
    let pool_line = format!(
        "0 {} thin-pool meta data {BS} 0{}",
        16 * BS,
        if skip { " 1 skip_block_zeroing" } else { "" }
    );
    // Per sector: the version it must at least hold, and what was written
    // since (any of which may have survived).
    let mut floor = vec![0u64; VOL as usize];
    let mut since: Vec<HashSet<u64>> = vec![HashSet::new(); VOL as usize];
    let mut tag = seed << 24;
    for life in 0..2u64 {
        let t = Tester::new();
        let pool = devs
            .try_table(&pool_line)
            .map(|tb| udm_mapper::MappedDevice::new("pool", tb))
            .map_err(|e| format!("life {life}: the pool did not open: {e}"))?;
        let mut d = devs.clone();
        d.add(as_dev(&pool));
        if life == 0 {
            pool.message(0, &["create_thin", "0"])
                .map_err(|e| e.to_string())?;
        } else {
            thin_check(&t, &(meta.clone() as Arc<dyn BlockDevice>))
                .map_err(|e| format!("after the cut: {e}"))?;
        }
        let vol = d
            .try_table(&format!("0 {VOL} thin pool 0"))
            .map(|tb| udm_mapper::MappedDevice::new("t", tb))
            .map_err(|e| format!("life {life}: the volume did not open: {e}"))?;
        let dev = as_dev(&vol);
        // What survived the last cut: each sector one of the allowed versions.
        let all = t.run(&dev, Req::read(0, VOL));
        if all.status != Status::Ok {
            return Err(format!(
                "life {life}: reading back failed: {:?}",
                all.status
            ));
        }
        for x in 0..VOL {
            let got = &all.data[(x * 512) as usize..((x + 1) * 512) as usize];
            match tag_of(x, got) {
                Some(g) if g == floor[x as usize] || since[x as usize].contains(&g) => {
                    floor[x as usize] = g;
                    since[x as usize].clear();
                }
                // Never made durable, in a block provisioned unzeroed.
                _ if skip && floor[x as usize] == 0 => since[x as usize].clear(),
                g => {
                    return Err(format!(
                        "life {life}: sector {x} holds {g:?}, allowed {} or {:?}",
                        floor[x as usize], since[x as usize]
                    ))
                }
            }
        }
        let ch = t.open(&dev);
        let ops = rng.range(5, 40);
        for _ in 0..ops {
            if rng.range(0, 5) == 0 {
                let d = submit(&t.reactor, &*ch, Req::flush()).finish_on(&t);
                if d.status != Status::Ok {
                    return Err(format!("flush failed: {:?}", d.status));
                }
                for (f, s) in floor.iter_mut().zip(since.iter_mut()) {
                    if let Some(&m) = s.iter().max() {
                        *f = m;
                    }
                    s.clear();
                }
                continue;
            }
            let n = if rng.range(0, 2) == 0 {
                BS
            } else {
                rng.range(1, 16)
            };
            let s = rng.range(0, VOL - n);
            tag += 1;
            let fua = rng.range(0, 5) == 0;
            let mut r = Req::write(s, pattern(tag, s, n));
            if fua {
                r = r.flags(BioFlags::FUA);
            }
            let d = submit(&t.reactor, &*ch, r).finish_on(&t);
            if d.status != Status::Ok {
                return Err(format!("write failed before the cut: {:?}", d.status));
            }
            for x in s..s + n {
                if fua {
                    floor[x as usize] = tag;
                    since[x as usize].clear();
                } else {
                    since[x as usize].insert(tag);
                }
            }
        }
        // The cut, with a few writes in flight: each may or may not land.
        let mut inflight = Vec::new();
        for _ in 0..rng.range(0, 4) {
            let n = rng.range(1, BS);
            let s = rng.range(0, VOL - n);
            tag += 1;
            for x in s..s + n {
                since[x as usize].insert(tag);
            }
            inflight.push(submit(&t.reactor, &*ch, Req::write(s, pattern(tag, s, n))));
        }
        for _ in 0..rng.range(0, 8) {
            t.reactor.poll_once();
        }
        power.cut();
        t.wait_all(&inflight);
        drop((inflight, ch, dev, vol, pool, d, t));
        let t = Tester::new();
        let tear = seed % 2 == 1;
        let mut r2 = Rng::new(seed ^ 0x7417 ^ life);
        let mut next = || r2.next_u64();
        meta.restore(&t.reactor, tear, &mut next)
            .map_err(|e| e.to_string())?;
        data.restore(&t.reactor, tear, &mut next)
            .map_err(|e| e.to_string())?;
        power.on();
    }
    Ok(())
}

trait FinishOn {
    fn finish_on(self, t: &Tester) -> Done;
}

impl FinishOn for InFlight {
    fn finish_on(self, t: &Tester) -> Done {
        t.wait_all(std::slice::from_ref(&self));
        self.finish()
    }
}

#[test]
fn a_power_cut_loses_nothing_flushed_and_leaves_metadata_that_checks() {
    let n: u64 = std::env::var("UDM_THIN_CRASH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    for seed in 1..=n {
        if let Err(e) = trial(seed) {
            panic!("seed {seed}: {e}");
        }
    }
}
