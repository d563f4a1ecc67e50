//! A null ublk device served by the `libublk` crate, the way its own
//! `null` example serves one (synchronous queue loop, one buffer per tag,
//! every request answered with its length): the floor that any ublk server
//! pays in this kernel.
//!
//! ```sh
//! ublk-null-ref ID QUEUES DEPTH SIZE_MIB    # runs until the device is deleted
//! ```

use libublk::ctrl::UblkCtrlBuilder;
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{BufDesc, UblkFlags, UblkIORes};
use std::rc::Rc;

fn queue(qid: u16, dev: &UblkDev) {
    let bufs = Rc::new(dev.alloc_queue_io_bufs());
    let b = bufs.clone();
    let handler = move |q: &UblkQueue, tag: u16, _: &UblkIOCtx| {
        let bytes = (q.get_iod(tag).nr_sectors << 9) as i32;
        let desc = BufDesc::Slice(b[tag as usize].as_slice());
        if let Err(e) = q.complete_io_cmd_unified(tag, desc, Ok(UblkIORes::Result(bytes))) {
            eprintln!("ublk-null-ref: queue {qid} tag {tag}: {e:?}");
        }
    };
    match UblkQueue::new(qid, dev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(q) => q.wait_and_handle_io(handler),
        Err(e) => eprintln!("ublk-null-ref: queue {qid}: {e:?}"),
    }
}

fn main() {
    let a: Vec<u64> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap_or(0))
        .collect();
    let [id, queues, depth, mib] = a[..] else {
        eprintln!("usage: ublk-null-ref ID QUEUES DEPTH SIZE_MIB");
        std::process::exit(2);
    };
    let ctrl = UblkCtrlBuilder::default()
        .name("ublk-null-ref")
        .id(id as i32)
        .nr_queues(queues as u16)
        .depth(depth as u16)
        .io_buf_bytes(512 << 10)
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build();
    let ctrl = match ctrl {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ublk-null-ref: adding device {id}: {e:?}");
            std::process::exit(1);
        }
    };
    let init = move |dev: &mut UblkDev| {
        dev.set_default_params(mib << 20);
        Ok(())
    };
    let started = |c: &libublk::ctrl::UblkCtrl| {
        println!("ublk-null-ref: /dev/ublkb{} ready", c.dev_info().dev_id);
    };
    if let Err(e) = ctrl.run_target(init, queue, started) {
        eprintln!("ublk-null-ref: {e:?}");
        std::process::exit(1);
    }
}
