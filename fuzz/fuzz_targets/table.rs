//! Feeds arbitrary bytes, as table text, to the table parser and to
//! `Table::from_text` over a few small RAM disks: every input gives a table
//! or an error, never a panic.
#![no_main]

use std::collections::HashMap;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use udm_backends::RamDevice;
use udm_core::{BlockDevice, Error};
use udm_mapper::fuzzing;

/// Fresh devices for each input (a writecache leaves metadata on its
/// cache: shared devices would make an input's outcome depend on those
/// before it): r0, r1 of 64 KiB, r2 of 1 MiB (room for a writecache's
/// cache).
fn devices() -> HashMap<&'static str, Arc<dyn BlockDevice>> {
    [("r0", 64 << 10), ("r1", 64 << 10), ("r2", 1 << 20)]
        .into_iter()
        .map(|(name, bytes)| {
            let d: Arc<dyn BlockDevice> = Arc::new(RamDevice::new(name, bytes).expect("ram device"));
            (name, d)
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let devs = devices();
    let resolve = |name: &str| -> Result<Arc<dyn BlockDevice>, Error> {
        devs.get(name)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("no device '{name}'")))
    };
    fuzzing::table(data, &resolve);
});
