//! Every mirrored struct's size and field offsets, and the command
//! numbers, against the kernel header as the system's C compiler sees it.
//! Fields newer than the installed header are checked when it has them.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use udm_core::testing::TempDir;

use super::*;

/// `(key, value)` for everything checked: `struct.field` offsets,
/// `struct` sizes, command numbers.
fn ours() -> BTreeMap<&'static str, u64> {
    macro_rules! layout {
        ($m:ident, $c:literal, $t:ty, [$($f:ident),*]) => {
            $m.insert(concat!($c, ".size"), size_of::<$t>() as u64);
            $($m.insert(concat!($c, ".", stringify!($f)), offset_of!($t, $f) as u64);)*
        };
    }
    let mut m = BTreeMap::new();
    layout!(
        m,
        "ublksrv_ctrl_cmd",
        CtrlCmd,
        [dev_id, queue_id, len, addr, data, dev_path_len]
    );
    layout!(
        m,
        "ublksrv_ctrl_dev_info",
        DevInfo,
        [
            nr_hw_queues,
            queue_depth,
            state,
            max_io_buf_bytes,
            dev_id,
            ublksrv_pid,
            flags,
            ublksrv_flags,
            owner_uid,
            owner_gid,
            reserved1,
            reserved2
        ]
    );
    layout!(
        m,
        "ublksrv_io_desc",
        IoDesc,
        [op_flags, nr_sectors, start_sector, addr]
    );
    layout!(m, "ublksrv_io_cmd", IoCmd, [q_id, tag, result, addr]);
    layout!(
        m,
        "ublk_param_basic",
        ParamBasic,
        [
            attrs,
            logical_bs_shift,
            physical_bs_shift,
            io_opt_shift,
            io_min_shift,
            max_sectors,
            chunk_sectors,
            dev_sectors,
            virt_boundary_mask
        ]
    );
    layout!(
        m,
        "ublk_param_discard",
        ParamDiscard,
        [
            discard_alignment,
            discard_granularity,
            max_discard_sectors,
            max_write_zeroes_sectors,
            max_discard_segments
        ]
    );
    m.insert("ublk_params.len", offset_of!(Params, len) as u64);
    m.insert("ublk_params.types", offset_of!(Params, types) as u64);
    m.insert("ublk_params.basic", offset_of!(Params, basic) as u64);
    m.insert("ublk_params.discard", offset_of!(Params, discard) as u64);
    for (k, v) in [
        ("UBLK_U_CMD_GET_DEV_INFO", UBLK_U_CMD_GET_DEV_INFO),
        ("UBLK_U_CMD_ADD_DEV", UBLK_U_CMD_ADD_DEV),
        ("UBLK_U_CMD_DEL_DEV", UBLK_U_CMD_DEL_DEV),
        ("UBLK_U_CMD_START_DEV", UBLK_U_CMD_START_DEV),
        ("UBLK_U_CMD_STOP_DEV", UBLK_U_CMD_STOP_DEV),
        ("UBLK_U_CMD_SET_PARAMS", UBLK_U_CMD_SET_PARAMS),
        ("UBLK_U_CMD_GET_PARAMS", UBLK_U_CMD_GET_PARAMS),
        (
            "UBLK_U_CMD_START_USER_RECOVERY",
            UBLK_U_CMD_START_USER_RECOVERY,
        ),
        ("UBLK_U_CMD_END_USER_RECOVERY", UBLK_U_CMD_END_USER_RECOVERY),
        ("UBLK_U_IO_FETCH_REQ", UBLK_U_IO_FETCH_REQ),
        (
            "UBLK_U_IO_COMMIT_AND_FETCH_REQ",
            UBLK_U_IO_COMMIT_AND_FETCH_REQ,
        ),
    ] {
        m.insert(k, v as u64);
    }
    for (k, v) in [
        ("UBLK_IO_RES_ABORT", UBLK_IO_RES_ABORT as i64),
        ("UBLK_F_USER_RECOVERY", UBLK_F_USER_RECOVERY as i64),
        (
            "UBLK_F_USER_RECOVERY_REISSUE",
            UBLK_F_USER_RECOVERY_REISSUE as i64,
        ),
        (
            "UBLK_F_URING_CMD_COMP_IN_TASK",
            UBLK_F_URING_CMD_COMP_IN_TASK as i64,
        ),
        ("UBLK_S_DEV_LIVE", UBLK_S_DEV_LIVE as i64),
        ("UBLK_S_DEV_QUIESCED", UBLK_S_DEV_QUIESCED as i64),
        ("UBLK_IO_OP_WRITE_ZEROES", UBLK_IO_OP_WRITE_ZEROES as i64),
        ("UBLK_IO_OP_DISCARD", UBLK_IO_OP_DISCARD as i64),
        ("UBLK_IO_F_FUA", UBLK_IO_F_FUA as i64),
        ("UBLK_ATTR_VOLATILE_CACHE", UBLK_ATTR_VOLATILE_CACHE as i64),
        ("UBLK_ATTR_FUA", UBLK_ATTR_FUA as i64),
        ("UBLK_PARAM_TYPE_DISCARD", UBLK_PARAM_TYPE_DISCARD as i64),
        ("UBLK_MAX_QUEUE_DEPTH", UBLK_MAX_QUEUE_DEPTH as i64),
        ("UBLK_F_UNPRIVILEGED_DEV", UBLK_F_UNPRIVILEGED_DEV as i64),
    ] {
        m.insert(k, v as u64);
    }
    m
}

/// The C program: prints `key value` for what the header has.
const PROBE: &str = r#"
#include <stdio.h>
#include <stddef.h>
#include <linux/ioctl.h>
#include <linux/ublk_cmd.h>
#define S(t) printf(#t ".size %zu\n", sizeof(struct t));
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(struct t, f));
#define V(c) printf(#c " %llu\n", (unsigned long long)(c));
/* The command numbers, as the header spells them or, in headers older
   than the ioctl encoding, as the kernel computes them. */
#ifndef UBLK_U_CMD_ADD_DEV
#define UBLK_U_CMD_GET_DEV_INFO _IOR('u', UBLK_CMD_GET_DEV_INFO, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_ADD_DEV _IOWR('u', UBLK_CMD_ADD_DEV, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_DEL_DEV _IOWR('u', UBLK_CMD_DEL_DEV, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_START_DEV _IOWR('u', UBLK_CMD_START_DEV, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_STOP_DEV _IOWR('u', UBLK_CMD_STOP_DEV, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_SET_PARAMS _IOWR('u', UBLK_CMD_SET_PARAMS, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_GET_PARAMS _IOR('u', UBLK_CMD_GET_PARAMS, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_START_USER_RECOVERY _IOWR('u', UBLK_CMD_START_USER_RECOVERY, struct ublksrv_ctrl_cmd)
#define UBLK_U_CMD_END_USER_RECOVERY _IOWR('u', UBLK_CMD_END_USER_RECOVERY, struct ublksrv_ctrl_cmd)
#define UBLK_U_IO_FETCH_REQ _IOWR('u', UBLK_IO_FETCH_REQ, struct ublksrv_io_cmd)
#define UBLK_U_IO_COMMIT_AND_FETCH_REQ _IOWR('u', UBLK_IO_COMMIT_AND_FETCH_REQ, struct ublksrv_io_cmd)
#endif
#define ENODEV 19
int main(void) {
    S(ublksrv_ctrl_cmd) O(ublksrv_ctrl_cmd, dev_id) O(ublksrv_ctrl_cmd, queue_id)
    O(ublksrv_ctrl_cmd, len) O(ublksrv_ctrl_cmd, addr) O(ublksrv_ctrl_cmd, data)
#ifdef UBLK_CMD_GET_DEV_INFO2
    O(ublksrv_ctrl_cmd, dev_path_len)
#endif
    S(ublksrv_ctrl_dev_info) O(ublksrv_ctrl_dev_info, nr_hw_queues)
    O(ublksrv_ctrl_dev_info, queue_depth) O(ublksrv_ctrl_dev_info, state)
    O(ublksrv_ctrl_dev_info, max_io_buf_bytes) O(ublksrv_ctrl_dev_info, dev_id)
    O(ublksrv_ctrl_dev_info, ublksrv_pid) O(ublksrv_ctrl_dev_info, flags)
    O(ublksrv_ctrl_dev_info, ublksrv_flags)
#ifdef UBLK_F_UNPRIVILEGED_DEV
    O(ublksrv_ctrl_dev_info, owner_uid) O(ublksrv_ctrl_dev_info, owner_gid)
#endif
    O(ublksrv_ctrl_dev_info, reserved1) O(ublksrv_ctrl_dev_info, reserved2)
    S(ublksrv_io_desc) O(ublksrv_io_desc, op_flags) O(ublksrv_io_desc, nr_sectors)
    O(ublksrv_io_desc, start_sector) O(ublksrv_io_desc, addr)
    S(ublksrv_io_cmd) O(ublksrv_io_cmd, q_id) O(ublksrv_io_cmd, tag)
    O(ublksrv_io_cmd, result) O(ublksrv_io_cmd, addr)
    S(ublk_param_basic) O(ublk_param_basic, attrs) O(ublk_param_basic, logical_bs_shift)
    O(ublk_param_basic, physical_bs_shift) O(ublk_param_basic, io_opt_shift)
    O(ublk_param_basic, io_min_shift) O(ublk_param_basic, max_sectors)
    O(ublk_param_basic, chunk_sectors) O(ublk_param_basic, dev_sectors)
    O(ublk_param_basic, virt_boundary_mask)
    S(ublk_param_discard) O(ublk_param_discard, discard_alignment)
    O(ublk_param_discard, discard_granularity) O(ublk_param_discard, max_discard_sectors)
    O(ublk_param_discard, max_write_zeroes_sectors) O(ublk_param_discard, max_discard_segments)
    O(ublk_params, len) O(ublk_params, types) O(ublk_params, basic) O(ublk_params, discard)
    V(UBLK_U_CMD_GET_DEV_INFO) V(UBLK_U_CMD_ADD_DEV) V(UBLK_U_CMD_DEL_DEV)
    V(UBLK_U_CMD_START_DEV) V(UBLK_U_CMD_STOP_DEV) V(UBLK_U_CMD_SET_PARAMS)
    V(UBLK_U_CMD_GET_PARAMS) V(UBLK_U_CMD_START_USER_RECOVERY)
    V(UBLK_U_CMD_END_USER_RECOVERY) V(UBLK_U_IO_FETCH_REQ) V(UBLK_U_IO_COMMIT_AND_FETCH_REQ)
    V(UBLK_IO_RES_ABORT) V(UBLK_F_USER_RECOVERY) V(UBLK_F_USER_RECOVERY_REISSUE)
    V(UBLK_F_URING_CMD_COMP_IN_TASK) V(UBLK_S_DEV_LIVE) V(UBLK_S_DEV_QUIESCED)
    V(UBLK_IO_OP_WRITE_ZEROES) V(UBLK_IO_OP_DISCARD) V(UBLK_IO_F_FUA)
    V(UBLK_ATTR_VOLATILE_CACHE) V(UBLK_ATTR_FUA) V(UBLK_PARAM_TYPE_DISCARD)
    V(UBLK_MAX_QUEUE_DEPTH)
#ifdef UBLK_F_UNPRIVILEGED_DEV
    V(UBLK_F_UNPRIVILEGED_DEV)
#endif
    return 0;
}
"#;

#[test]
fn every_struct_offset_and_command_matches_the_kernel_header() {
    if !std::path::Path::new("/usr/include/linux/ublk_cmd.h").exists() {
        panic!("no /usr/include/linux/ublk_cmd.h: install linux-libc-dev (scripts/setup.sh)");
    }
    let dir = TempDir::new("ublk-abi");
    let (src, bin) = (dir.path("probe.c"), dir.path("probe"));
    std::fs::write(&src, PROBE).unwrap();
    let cc = Command::new("cc")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("cc");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&bin).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let ours = ours();
    let mut checked = 0;
    for line in text.lines() {
        let (k, v) = line.split_once(' ').unwrap();
        // ENODEV as the header's expression gives it, signed.
        let v: u64 = if k == "UBLK_IO_RES_ABORT" {
            v.parse::<u64>().unwrap() as i32 as i64 as u64
        } else {
            v.parse().unwrap()
        };
        let Some(&mine) = ours.get(k) else {
            panic!("the probe printed {k}, which the test does not know");
        };
        assert_eq!(mine, v, "{k}: ours {mine}, the header's {v}");
        checked += 1;
    }
    // Everything but what only newer headers have was compared.
    assert!(
        checked >= ours.len() - 4,
        "{checked} of {} checked",
        ours.len()
    );
}
