# The stacks the raid1 benchmarks compare (sourced by raid.sh,
# raid-ab.sh and raid-footprint.sh), each echoed as `udm bench` options
# for `eval`: SIZE is each leg's (and linear's device's) size, SECTORS
# the device's length.
#   raid_lin SIZE SECTORS      linear over one preallocated RAM disk
#   raid_mirror SIZE SECTORS   raid1 over two, with 1 MiB metadata devices
#                              (nosync; daemon_sleep keeps regions dirty)
#   raid_nometa SIZE SECTORS   raid1 over two, `-` for metadata (no bitmap)
#   raid_cases SIZE SECTORS    fills the array CASE: each named case's
#                              stack and workload (raid.sh, raid-ab.sh)
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
raid_cases() {
    local lin raid nometa
    lin=$(raid_lin "$1" "$2"); raid=$(raid_mirror "$1" "$2"); nometa=$(raid_nometa "$1" "$2")
    declare -gA CASE=(
        [lin_read]="$lin --rw randread"
        [raid_read]="$raid --rw randread"
        [lin_write]="$lin --rw randwrite"
        [raid_write]="$raid --rw randwrite"
        [nometa_write]="$nometa --rw randwrite"
        [lin_rw]="$lin --rw randrw"
        [raid_rw]="$raid --rw randrw"
        [raid_read_2jobs]="$raid --rw randread --jobs 2"
    )
}
per_cpu() {
    python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["iops"] if "'"${METRIC:-cpu}"'"=="iops" else j["ios"]/max(0.01, j["cpu_user_s"]+j["cpu_sys_s"]))'
}
