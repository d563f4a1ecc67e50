//! A Linux guest (the test guest of `scripts/guest/`, QEMU/TCG) on a udm
//! vhost-user-blk export: the kernel's virtio-blk driver, with two queues,
//! over udm's linear over a file. fio writes and verifies, blkdiscard
//! leaves zeroes, and what the guest wrote is in the file on the host.

#![allow(clippy::unwrap_used)]

mod common;

use common::guest::Guest;
use common::{Serve, TempDir};

#[test]
fn a_linux_guest_writes_verifies_and_discards_on_a_vhost_user_blk_export() {
    let dir = TempDir::new("vhost-guest");
    let img = dir.path("disk.img");
    let sock = dir.path("vda.vhost");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let srv = Serve::start_as_given(&[
        "--dev",
        &format!("f=file:{}", img.display()),
        "--dev",
        "lin=0 262144 linear f 0",
        "--vhost-user-blk",
        sock.to_str().unwrap(),
        "--queues",
        "2",
    ]);
    let text = Guest::new(
        &dir,
        r#"
echo "vda: $(cat /sys/block/vda/size) sectors, $(ls /sys/block/vda/mq | wc -l) queues"
[ "$(cat /sys/block/vda/size)" = 262144 ]
[ "$(ls /sys/block/vda/mq | wc -l)" = 2 ]
[ "$(cat /sys/block/vda/queue/discard_max_bytes)" != 0 ]
fio --name=verify --filename=/dev/vda --direct=1 --ioengine=psync --rw=randwrite \
    --bs=4k --size=32m --numjobs=2 --offset_increment=32m --verify=crc32c \
    --verify_fatal=1 --group_reporting | grep -E 'err=|WRITE:|READ:'
fio --name=seq --filename=/dev/vda --direct=1 --ioengine=psync --rw=write --bs=1m \
    --offset=64m --size=16m --verify=md5 --verify_fatal=1 | grep -E 'err=|WRITE:'
blkdiscard -o 0 -l 1048576 /dev/vda
dd if=/dev/vda bs=1M count=1 2>/dev/null | cmp - /dev/zero -n 1048576 && echo discarded
printf 'udm-guest-mark' | dd of=/dev/vda bs=512 seek=200000 conv=fsync 2>/dev/null
sync
"#,
    )
    .mem("512M")
    .qemu_args(format!(
        "-chardev socket,id=c0,path={} -device vhost-user-blk-pci,chardev=c0,num-queues=2",
        sock.display()
    ))
    .run(|| format!("\nudm:\n{}", srv.log()));
    assert!(text.contains("discarded"), "{text}");
    // The guest's last write is in the file, at its offset.
    let data = std::fs::read(&img).unwrap();
    let at = 200000 * 512;
    assert_eq!(&data[at..at + 14], b"udm-guest-mark", "{text}");
}
