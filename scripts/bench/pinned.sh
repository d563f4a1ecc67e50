# Sourced by the writecache benchmark scripts: `udm bench` with its job
# thread pinned (CPU, default 0). Unpinned, the raw device's own figure was
# bimodal on this 2-vCPU VM (5.8-6.0 or 7.0-7.6 GiB/s, run by run, 10 runs
# each way); pinned it held 7.2-7.9 in 6 of 8 runs. `--cpus` also keeps
# the bench's other threads (the writecache's worker) off that CPU, on the
# other vCPU, as dm-writecache's workqueues run beside the submitter.
#
#   bench_pinned UDM_BINARY BENCH_OPTIONS...
CPU=${CPU:-0}
bench_pinned() {
    local udm=$1
    shift
    "$udm" bench --cpus "$CPU" "$@"
}
