# The stacks the raid1 benchmarks compare (sourced by raid.sh,
# raid-ab.sh and raid-footprint.sh), each echoed as `udm bench` options
# for `eval`: SIZE is each leg's (and linear's device's) size, SECTORS
# the device's length.
#   raid_lin SIZE SECTORS      linear over one preallocated RAM disk
#   raid_mirror SIZE SECTORS   raid1 over two, with 1 MiB metadata devices
#                              (nosync; daemon_sleep keeps regions dirty)
#   raid_nometa SIZE SECTORS   raid1 over two, `-` for metadata (no bitmap)
#   per_cpu                    a bench's JSON on stdin: I/Os per CPU-second
#                              (METRIC=iops: its IOPS)
raid_lin() { echo "--dev ram0=ram:$1,prealloc --dev 'lin=0 $2 linear ram0 0' --target lin"; }
raid_mirror() {
    echo "--dev m0=ram:1M --dev d0=ram:$1,prealloc --dev m1=ram:1M --dev d1=ram:$1,prealloc" \
        "--dev 'r=0 $2 raid raid1 4 0 nosync daemon_sleep 100000 2 m0 d0 m1 d1' --target r"
}
raid_nometa() {
    echo "--dev d0=ram:$1,prealloc --dev d1=ram:$1,prealloc" \
        "--dev 'r=0 $2 raid raid1 2 0 nosync 2 - d0 - d1' --target r"
}
per_cpu() {
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["iops"] if "'"${METRIC:-cpu}"'"=="iops" else j["ios"]/max(0.01, j["cpu_user_s"]+j["cpu_sys_s"]))'
}
