/*
 * Why a batch of 4 KiB copies out of a large RAM disk costs less CPU per
 * copy than the same copies one at a time with an I/O's bookkeeping
 * between them (docs/benchmarks.md, "The RAM disk's reads, copied back to
 * back"). Random 4 KiB pages of an anonymous mapping (transparent huge
 * pages off, as the RAM disk's; HUGE=1: on) are copied into QD slot
 * buffers (WRITE=1: the other way), with BK rounds of a stand-in for an
 * end_io's work (a dependent multiply chain and histogram stores, ~90 ns
 * at BK=100) per copy, the modes interleaved in rounds in one process;
 * prints each mode's median ns of thread CPU time per copy and its median
 * speed against the first mode of the list.
 *
 *   cc -O2 -march=native -o /tmp/copy-overlap scripts/bench/copy-overlap.c
 *   /tmp/copy-overlap MiB MODES COPIES ROUNDS [BK=100] [QD=32] [PREFETCH_LINES=1]
 *   e.g. /tmp/copy-overlap 256 dbsfFpPn 200000 15
 *
 * Modes: d  each copy right after its bookkeeping (direct dispatch)
 *        b  QD bookkeepings, then QD copies back to back (a batch)
 *        s  as b, the batch sorted by address first (queued dispatch)
 *        f  as b, with an lfence after each copy: a copy's loads cannot
 *           start before the one before it has all its data
 *        F  as d, with an lfence after each copy
 *        p  as b, each page's first lines prefetched at "submission"
 *        P  as d, but each copy done one round later, its first lines
 *           prefetched at "submission" (copy at completion)
 *        n  bookkeeping only, no copy
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define PAGE 4096
#define MAXQD 256
#define MAXROUNDS 64
static uint8_t *disk, *slots;
static size_t npages;
static uint64_t hist[4096], rng = 88172645463325252ull;
static int BK = 100, QD = 32, NPF = 1, WR;

static inline size_t nextpage(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng % npages;
}
__attribute__((noinline)) static void bookkeep(uint64_t x) {
    uint64_t h = x;
    for (int i = 0; i < BK; i++) {
        h = h * 6364136223846793005ull + 1442695040888963407ull;
        hist[(h >> 40) & 4095]++;
    }
}
static inline void pf(size_t p) {
    for (int i = 0; i < NPF; i++)
        _mm_prefetch((const char *)disk + p * PAGE + 64 * i, _MM_HINT_T0);
}
static inline void cp(size_t p, int k) {
    uint8_t *s = disk + p * PAGE, *d = slots + (size_t)k * PAGE;
    if (WR)
        memcpy(s, d, PAGE);
    else
        memcpy(d, s, PAGE);
}
static double cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static int cmpz(const void *a, const void *b) {
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return x < y ? -1 : x > y;
}

static double run(char mode, long n) {
    static size_t pend[MAXQD];
    static int primed;
    size_t pg[MAXQD];
    double t0 = cpu();
    for (long done = 0; done < n; done += QD) {
        switch (mode) {
        case 'd':
        case 'F':
            for (int k = 0; k < QD; k++) {
                bookkeep(k);
                cp(nextpage(), k);
                if (mode == 'F')
                    _mm_lfence();
            }
            break;
        case 'b':
        case 's':
        case 'f':
        case 'p':
            for (int k = 0; k < QD; k++) {
                bookkeep(k);
                pg[k] = nextpage();
                if (mode == 'p')
                    pf(pg[k]);
            }
            if (mode == 's')
                qsort(pg, QD, sizeof pg[0], cmpz);
            for (int k = 0; k < QD; k++) {
                cp(pg[k], k);
                if (mode == 'f')
                    _mm_lfence();
            }
            break;
        case 'P':
            if (!primed) {
                for (int k = 0; k < QD; k++)
                    pf(pend[k] = nextpage());
                primed = 1;
            }
            for (int k = 0; k < QD; k++) {
                bookkeep(k);
                cp(pend[k], k);
                pf(pend[k] = nextpage());
            }
            break;
        case 'n':
            for (int k = 0; k < QD; k++) {
                bookkeep(k);
                nextpage();
            }
            break;
        default:
            fprintf(stderr, "copy-overlap: unknown mode '%c'\n", mode);
            exit(2);
        }
    }
    return (cpu() - t0) / n * 1e9;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MiB MODES COPIES ROUNDS [BK] [QD] [PREFETCH_LINES]\n", argv[0]);
        return 2;
    }
    size_t mib = strtoul(argv[1], 0, 10);
    const char *modes = argv[2];
    long n = atol(argv[3]);
    int rounds = atoi(argv[4]), nm = strlen(modes);
    if (argc > 5) BK = atoi(argv[5]);
    if (argc > 6) QD = atoi(argv[6]);
    if (argc > 7) NPF = atoi(argv[7]);
    WR = getenv("WRITE") != 0;
    if (QD < 1 || QD > MAXQD || rounds < 1 || rounds > MAXROUNDS || nm > 16 || mib < 1) {
        fprintf(stderr, "copy-overlap: QD 1-%d, ROUNDS 1-%d, at most 16 modes\n", MAXQD, MAXROUNDS);
        return 2;
    }
    npages = mib * 1024 * 1024 / PAGE;
    disk = mmap(0, npages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    slots = aligned_alloc(PAGE, (size_t)MAXQD * PAGE);
    if (disk == MAP_FAILED || !slots) {
        perror("copy-overlap");
        return 1;
    }
    madvise(disk, npages * PAGE, getenv("HUGE") ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(disk, 1, npages * PAGE);
    memset(slots, 0, (size_t)MAXQD * PAGE);
    static double r[16][MAXROUNDS];
    for (int j = 0; j < rounds; j++)
        for (int i = 0; i < nm; i++) {
            int m = (j & 1) ? nm - 1 - i : i; /* the order reversed every other round */
            r[m][j] = run(modes[m], n);
        }
    for (int i = 0; i < nm; i++) {
        double ns[MAXROUNDS], sp[MAXROUNDS];
        for (int j = 0; j < rounds; j++) {
            ns[j] = r[i][j];
            sp[j] = r[0][j] / r[i][j];
        }
        qsort(ns, rounds, sizeof ns[0], cmp);
        qsort(sp, rounds, sizeof sp[0], cmp);
        printf("%c: %6.1f ns per copy, speed %.2f (%.2f-%.2f) of %c's\n", modes[i], ns[rounds / 2],
               sp[rounds / 2], sp[0], sp[rounds - 1], modes[0]);
    }
    return hist[0] == UINT64_MAX; /* keeps the bookkeeping */
}
