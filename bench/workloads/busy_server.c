/* A busy server for offtop's busy-server benchmark (bench/busy_server.py).
 *
 * Usage: bench_busy [--procs N] [--threads N] [--rate BLOCKS_PER_S]
 *                   [--churn PROCS_PER_S] [--variants V] [--io-dir DIR]
 *
 *   N processes (default 20) of N threads (default 50). Each thread loops:
 *   it picks one of 8 blocking code paths and one of V call routes for it
 *   (default 1: each thread has 8 stacks of its own), descends through 1 to
 *   8 layers of distinctly named functions chosen by the route, and blocks
 *   2-50 ms in the path's named function:
 *
 *     busy_path_nanosleep    clock_nanosleep
 *     busy_path_pipe_read    read of a pipe no one writes (a per-thread timer
 *                            signal ends it: EINTR)
 *     busy_path_futex_wait   FUTEX_WAIT with a timeout
 *     busy_path_poll         poll of that pipe, with a timeout
 *     busy_path_epoll_wait   epoll_wait on it, with a timeout
 *     busy_path_select       select on it, with a timeout
 *     busy_path_socket_recv  recvfrom on a TCP connection over loopback whose
 *                            peer never sends (SO_RCVTIMEO)
 *     busy_path_file_pread   a 4 KiB O_DIRECT pread of a file in DIR (default
 *                            "."): state D, as long as the disk takes (without
 *                            O_DIRECT the page is dropped from the cache first)
 *
 *   Block lengths are drawn from 2 + 48 * u^a ms (u uniform in [0,1)); once
 *   a second the driver moves a so that the measured blocks/s approach RATE
 *   (default 30000; 0: a = 1, no pacing). The routes are drawn from a
 *   per-process seed, and every worker is a fresh exec (its own address
 *   space), so the user stacks differ from process to process.
 *
 *   Churn: each worker exits after a random lifetime (mean PROCS / CHURN
 *   seconds; default CHURN 3 per second) and the driver starts a new one in
 *   its slot. Workers die with the driver (PR_SET_PDEATHSIG).
 *
 * Prints "ready pid=P paths=NAME,..." once every worker is started, then once
 * a second:
 *   stats t=SECONDS blocks=N voluntary=N involuntary=N cpu_us=N procs=LIVE
 *         started=N exited=N threads=LIVE mean_ms=M paths=B0,B1,...,B7
 * with cumulative counts, exited workers included: blocks (per path in
 * paths=), the workers' context switches and CPU time (getrusage, published
 * by each worker every 200 ms), workers started and exited.
 *
 * Blocking calls are inline syscalls written out in each named function, so
 * that function is the innermost user frame (as in
 * tests/workloads/offtop_workload.c); build with -fno-omit-frame-pointer.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/futex.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef __x86_64__
#error "bench_busy issues its blocking system calls by x86-64 inline assembly"
#endif

#define NPATHS 8
#define MAX_SLOTS 4096
#define LO_MS 2.0
#define HI_MS 50.0
#define IO_FILE_BYTES (1 << 20)
#define IO_BYTES 4096

static const char *const PATH_NAMES[NPATHS] = {
    "nanosleep", "pipe_read", "futex_wait", "poll", "epoll_wait", "select", "socket_recv", "file_pread",
};

/* Shared by the driver and its workers (a memfd inherited across exec). */
enum { USE_VOLUNTARY, USE_INVOLUNTARY, USE_CPU_US, NUSE };

struct slot {
    uint64_t blocks[NPATHS];
    uint64_t use_done[NUSE];    /* getrusage of the slot's finished workers, summed */
    uint64_t use_live[NUSE];    /* of its running worker, updated every 200 ms */
    int32_t threads;            /* worker threads running */
    char pad[64 - (NPATHS * 8 + 2 * NUSE * 8 + 4) % 64];
};

struct shared {
    double exponent;        /* a in 2 + 48 u^a ms, set by the driver */
    char pad[56];
    struct slot slots[MAX_SLOTS];
};

static struct shared *shm;

/* The syscall instruction has to sit in the named function itself: a macro,
 * not a helper that the compiler might keep out of line. */
#define SYSCALL6(ret, n, a, b, c, d, e, f) do {                                       \
        register long r10_ __asm__("r10") = (long)(d);                                 \
        register long r8_ __asm__("r8") = (long)(e);                                   \
        register long r9_ __asm__("r9") = (long)(f);                                   \
        __asm__ volatile ("syscall" : "=a"(ret)                                        \
                          : "a"((long)(n)), "D"((long)(a)), "S"((long)(b)),            \
                            "d"((long)(c)), "r"(r10_), "r"(r8_), "r"(r9_)              \
                          : "rcx", "r11", "memory");                                   \
    } while (0)

/* One worker thread's objects to block on. */
struct job {
    struct slot *slot;
    int index;              /* thread index within its process */
    uint64_t rng;
    uint64_t seed;          /* per process: picks the call routes */
    int variants;
    int pipe_rd, pipe_wr, epfd, sock, sock_peer, io_fd, io_direct;
    timer_t timer;
    int futex_word;
    char *io_buf;
};

static uint64_t next_random(uint64_t *s)
{
    /* xorshift64* */
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static uint64_t mix(uint64_t x)
{
    /* splitmix64's finalizer */
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static long draw_block_ns(struct job *j)
{
    double u = (double)(next_random(&j->rng) >> 11) / (double)(1ULL << 53);
    double a = shm->exponent;
    return (long)((LO_MS + (HI_MS - LO_MS) * pow(u, a)) * 1e6);
}

/* --- the eight blocking paths --------------------------------------------- */

__attribute__((noinline)) long busy_path_nanosleep(struct job *j, long ns)
{
    struct timespec ts = { ns / 1000000000L, ns % 1000000000L };
    long ret;
    (void)j;
    SYSCALL6(ret, SYS_clock_nanosleep, CLOCK_MONOTONIC, 0, &ts, NULL, 0, 0);
    return ret;
}

__attribute__((noinline)) long busy_path_pipe_read(struct job *j, long ns)
{
    /* No one writes: the thread's timer signal interrupts the read. The timer
     * repeats, so a signal that came before the read started cannot leave
     * the thread asleep for good. */
    struct itimerspec it = { { ns / 1000000000L, ns % 1000000000L },
                             { ns / 1000000000L, ns % 1000000000L } };
    struct itimerspec off = { { 0, 0 }, { 0, 0 } };
    char c;
    long ret;
    timer_settime(j->timer, 0, &it, NULL);
    SYSCALL6(ret, SYS_read, j->pipe_rd, &c, 1, 0, 0, 0);
    timer_settime(j->timer, 0, &off, NULL);
    return ret;
}

__attribute__((noinline)) long busy_path_futex_wait(struct job *j, long ns)
{
    struct timespec ts = { ns / 1000000000L, ns % 1000000000L };
    long ret;
    SYSCALL6(ret, SYS_futex, &j->futex_word, FUTEX_WAIT_PRIVATE, 0, &ts, 0, 0);
    return ret;
}

__attribute__((noinline)) long busy_path_poll(struct job *j, long ns)
{
    struct pollfd p = { j->pipe_rd, POLLIN, 0 };
    long ret;
    SYSCALL6(ret, SYS_poll, &p, 1, ns / 1000000L, 0, 0, 0);
    return ret;
}

__attribute__((noinline)) long busy_path_epoll_wait(struct job *j, long ns)
{
    struct epoll_event ev;
    long ret;
    SYSCALL6(ret, SYS_epoll_wait, j->epfd, &ev, 1, ns / 1000000L, 0, 0);
    return ret;
}

__attribute__((noinline)) long busy_path_select(struct job *j, long ns)
{
    fd_set rd;
    struct timeval tv = { ns / 1000000000L, (ns % 1000000000L) / 1000 };
    long ret;
    FD_ZERO(&rd);
    FD_SET(j->pipe_rd, &rd);
    SYSCALL6(ret, SYS_select, j->pipe_rd + 1, &rd, NULL, NULL, &tv, 0);
    return ret;
}

__attribute__((noinline)) long busy_path_socket_recv(struct job *j, long ns)
{
    struct timeval tv = { ns / 1000000000L, (ns % 1000000000L) / 1000 };
    char buf[64];
    long ret;
    setsockopt(j->sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    SYSCALL6(ret, SYS_recvfrom, j->sock, buf, sizeof(buf), 0, NULL, NULL);
    return ret;
}

__attribute__((noinline)) long busy_path_file_pread(struct job *j, long ns)
{
    long off = (long)(next_random(&j->rng) % (IO_FILE_BYTES / IO_BYTES)) * IO_BYTES;
    long ret;
    (void)ns;   /* as long as the disk takes */
    if (!j->io_direct)
        posix_fadvise(j->io_fd, off, IO_BYTES, POSIX_FADV_DONTNEED);
    SYSCALL6(ret, SYS_pread64, j->io_fd, j->io_buf, IO_BYTES, off, 0, 0);
    return ret;
}

typedef long (*path_fn)(struct job *, long);
static const path_fn PATHS[NPATHS] = {
    busy_path_nanosleep, busy_path_pipe_read, busy_path_futex_wait, busy_path_poll,
    busy_path_epoll_wait, busy_path_select, busy_path_socket_recv, busy_path_file_pread,
};

/* --- call routes: 1 to 8 layers, each one of four named functions -------- */

static long busy_layer(struct job *j, int path, long ns, unsigned depth, uint64_t route);

/* Each layer adds to what the one below returns, so no call is a tail call
 * (a tail call would leave no frame behind). */
__attribute__((noinline)) long busy_layer_accept(struct job *j, int path, long ns, unsigned depth,
                                                 uint64_t route)
{
    return busy_layer(j, path, ns, depth, route) + 1;
}

__attribute__((noinline)) long busy_layer_parse(struct job *j, int path, long ns, unsigned depth,
                                                uint64_t route)
{
    return busy_layer(j, path, ns, depth, route) + 2;
}

__attribute__((noinline)) long busy_layer_dispatch(struct job *j, int path, long ns, unsigned depth,
                                                   uint64_t route)
{
    return busy_layer(j, path, ns, depth, route) + 3;
}

__attribute__((noinline)) long busy_layer_handle(struct job *j, int path, long ns, unsigned depth,
                                                 uint64_t route)
{
    return busy_layer(j, path, ns, depth, route) + 4;
}

static long busy_layer(struct job *j, int path, long ns, unsigned depth, uint64_t route)
{
    if (depth == 0)
        return PATHS[path](j, ns);
    switch (route & 3) {
    case 0: return busy_layer_accept(j, path, ns, depth - 1, route >> 2);
    case 1: return busy_layer_parse(j, path, ns, depth - 1, route >> 2);
    case 2: return busy_layer_dispatch(j, path, ns, depth - 1, route >> 2);
    default: return busy_layer_handle(j, path, ns, depth - 1, route >> 2);
    }
}

/* --- a worker process ------------------------------------------------------ */

static void on_timer(int sig)
{
    (void)sig;
}

static int listen_fd = -1;
static struct sockaddr_in listen_addr;
static const char *io_path;

static void setup_job(struct job *j)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC))
        _exit(3);
    j->pipe_rd = p[0];
    j->pipe_wr = p[1];
    j->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = { .events = EPOLLIN, .data = { .fd = p[0] } };
    epoll_ctl(j->epfd, EPOLL_CTL_ADD, p[0], &ev);

    j->sock_peer = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(j->sock_peer, (struct sockaddr *)&listen_addr, sizeof(listen_addr)))
        _exit(4);
    /* Another thread may take this connection: each ends with one, idle either way. */
    j->sock = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (j->sock < 0)
        _exit(5);

    struct sigevent sev;
    memset(&sev, 0, sizeof(sev));
    sev.sigev_notify = SIGEV_THREAD_ID;
    sev.sigev_signo = SIGRTMIN;
    sev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
    if (timer_create(CLOCK_MONOTONIC, &sev, &j->timer))
        _exit(6);

    j->io_direct = 1;
    j->io_fd = open(io_path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (j->io_fd < 0) {
        j->io_direct = 0;
        j->io_fd = open(io_path, O_RDONLY | O_CLOEXEC);
    }
    if (j->io_fd < 0)
        _exit(7);
    j->io_buf = aligned_alloc(IO_BYTES, IO_BYTES);
}

__attribute__((noinline)) void *busy_worker_thread(void *arg)
{
    struct job *j = arg;
    char name[16];
    snprintf(name, sizeof(name), "busy_t%02d", j->index);
    prctl(PR_SET_NAME, name);
    setup_job(j);
    __atomic_add_fetch(&j->slot->threads, 1, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t r = next_random(&j->rng);
        int path = (int)(r % NPATHS);
        uint64_t variant = (r >> 8) % (uint64_t)j->variants;
        uint64_t route = mix(j->seed ^ mix(((uint64_t)j->index << 32) | ((uint64_t)path << 16) | variant));
        unsigned depth = 1 + (unsigned)(route & 7);
        busy_layer(j, path, draw_block_ns(j), depth, route >> 3);
        __atomic_add_fetch(&j->slot->blocks[path], 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

static int worker_main(int argc, char **argv)
{
    /* worker SLOT SEED LIFETIME_MS THREADS VARIANTS SHM_FD IO_PATH */
    if (argc != 9)
        return 2;
    int slot = atoi(argv[2]);
    uint64_t seed = strtoull(argv[3], NULL, 10);
    long lifetime_ms = atol(argv[4]);
    int threads = atoi(argv[5]);
    int variants = atoi(argv[6]);
    int shm_fd = atoi(argv[7]);
    io_path = argv[8];
    if (slot < 0 || slot >= MAX_SLOTS || threads < 1 || variants < 1)
        return 2;
    shm = mmap(NULL, sizeof(*shm), PROT_READ | PROT_WRITE, MAP_SHARED, shm_fd, 0);
    if (shm == MAP_FAILED)
        return 3;
    close(shm_fd);

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_timer;   /* no SA_RESTART: the pipe read returns EINTR */
    sigaction(SIGRTMIN, &sa, NULL);

    listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    listen_addr.sin_family = AF_INET;
    listen_addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(listen_addr);
    if (bind(listen_fd, (struct sockaddr *)&listen_addr, sizeof(listen_addr)) ||
        listen(listen_fd, threads + 16) ||
        getsockname(listen_fd, (struct sockaddr *)&listen_addr, &len))
        return 4;

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    struct job *jobs = calloc((size_t)threads, sizeof(*jobs));
    for (int i = 0; i < threads; i++) {
        jobs[i].slot = &shm->slots[slot];
        jobs[i].index = i;
        jobs[i].seed = seed;
        jobs[i].rng = mix(seed + 7919u * (uint64_t)(i + 1)) | 1;
        jobs[i].variants = variants;
        pthread_t t;
        if (pthread_create(&t, &attr, busy_worker_thread, &jobs[i]))
            return 5;
    }
    /* Publish this process's context switches and CPU (all its threads) every
     * 200 ms until the lifetime is over, then fold them into the slot's sum. */
    struct slot *me = &shm->slots[slot];
    struct timespec start, now, step = { 0, 200000000L };
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        uint64_t use[NUSE] = {
            (uint64_t)ru.ru_nvcsw, (uint64_t)ru.ru_nivcsw,
            (uint64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000u
                + (uint64_t)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec),
        };
        clock_gettime(CLOCK_MONOTONIC, &now);
        long lived_ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (lifetime_ms > 0 && lived_ms >= lifetime_ms) {
            for (int u = 0; u < NUSE; u++) {
                __atomic_store_n(&me->use_live[u], 0, __ATOMIC_RELAXED);
                __atomic_add_fetch(&me->use_done[u], use[u], __ATOMIC_RELAXED);
            }
            break;
        }
        for (int u = 0; u < NUSE; u++)
            __atomic_store_n(&me->use_live[u], use[u], __ATOMIC_RELAXED);
        nanosleep(&step, NULL);
    }
    __atomic_sub_fetch(&me->threads, threads, __ATOMIC_RELAXED);
    _exit(0);
}

/* --- the driver ------------------------------------------------------------- */

static volatile sig_atomic_t stopping;

static void on_stop(int sig)
{
    (void)sig;
    stopping = 1;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t total_blocks(int nslots, uint64_t per_path[NPATHS])
{
    uint64_t sum = 0;
    for (int p = 0; p < NPATHS; p++)
        per_path[p] = 0;
    for (int s = 0; s < nslots; s++)
        for (int p = 0; p < NPATHS; p++) {
            uint64_t b = __atomic_load_n(&shm->slots[s].blocks[p], __ATOMIC_RELAXED);
            per_path[p] += b;
            sum += b;
        }
    return sum;
}

struct spawner {
    const char *self, *io_file;
    int shm_fd, threads, variants;
    double life_mean_s;     /* 0: workers live for ever */
    pid_t driver;
    uint64_t rng, started, exited;
};

/* A fresh exec of this program as the worker of `slot`, with a new seed (new
 * call routes) and a lifetime. The first generation's lifetimes spread over
 * (0, 2 means), so exits come evenly from the start; later ones lie within
 * 50% of the mean. Returns the pid, or 0 if fork failed (retried later). */
static pid_t spawn(struct spawner *sp, int slot, int first)
{
    char a_slot[16], a_seed[32], a_life[32], a_threads[16], a_variants[16], a_fd[16];
    double u = (double)(next_random(&sp->rng) >> 11) / (double)(1ULL << 53);
    long life_ms = sp->life_mean_s > 0
        ? (long)(1000.0 * sp->life_mean_s * (first ? 0.05 + 1.95 * u : 0.5 + u)) : 0;
    snprintf(a_slot, sizeof(a_slot), "%d", slot);
    snprintf(a_seed, sizeof(a_seed), "%llu", (unsigned long long)next_random(&sp->rng));
    snprintf(a_life, sizeof(a_life), "%ld", life_ms);
    snprintf(a_threads, sizeof(a_threads), "%d", sp->threads);
    snprintf(a_variants, sizeof(a_variants), "%d", sp->variants);
    snprintf(a_fd, sizeof(a_fd), "%d", sp->shm_fd);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != sp->driver)
            _exit(0);
        execl(sp->self, "bench_busy", "worker", a_slot, a_seed, a_life, a_threads, a_variants,
              a_fd, sp->io_file, (char *)NULL);
        _exit(127);
    }
    if (pid < 0)
        return 0;
    sp->started++;
    return pid;
}

static void total_use(int nslots, uint64_t use[NUSE])
{
    for (int u = 0; u < NUSE; u++)
        use[u] = 0;
    for (int s = 0; s < nslots; s++)
        for (int u = 0; u < NUSE; u++)
            use[u] += __atomic_load_n(&shm->slots[s].use_done[u], __ATOMIC_RELAXED)
                      + __atomic_load_n(&shm->slots[s].use_live[u], __ATOMIC_RELAXED);
}

static void usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--procs N] [--threads N] [--rate BLOCKS_PER_S] [--churn PROCS_PER_S] "
                    "[--variants V] [--io-dir DIR]\n", argv0);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "worker"))
        return worker_main(argc, argv);

    int procs = 20, threads = 50, variants = 1;
    double rate = 30000, churn = 3;
    const char *io_dir = ".";
    static const struct option opts[] = {
        { "procs", required_argument, NULL, 'p' }, { "threads", required_argument, NULL, 't' },
        { "rate", required_argument, NULL, 'r' }, { "churn", required_argument, NULL, 'c' },
        { "variants", required_argument, NULL, 'v' }, { "io-dir", required_argument, NULL, 'd' },
        { NULL, 0, NULL, 0 },
    };
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        switch (c) {
        case 'p': procs = atoi(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'r': rate = atof(optarg); break;
        case 'c': churn = atof(optarg); break;
        case 'v': variants = atoi(optarg); break;
        case 'd': io_dir = optarg; break;
        default: usage(argv[0]); return 2;
        }
    }
    if (procs < 1 || procs > MAX_SLOTS || threads < 1 || variants < 1 || rate < 0 || churn < 0) {
        usage(argv[0]);
        return 2;
    }

    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0)
        return 2;
    self[n] = 0;

    int shm_fd = memfd_create("bench_busy", 0);   /* inherited across exec */
    if (shm_fd < 0 || ftruncate(shm_fd, sizeof(struct shared)))
        return 3;
    shm = mmap(NULL, sizeof(*shm), PROT_READ | PROT_WRITE, MAP_SHARED, shm_fd, 0);
    if (shm == MAP_FAILED)
        return 3;

    /* The file the file_pread path reads, written once and synced. */
    char io_file[4200];
    snprintf(io_file, sizeof(io_file), "%s/bench_busy.%d.dat", io_dir, getpid());
    int fd = open(io_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(io_file);
        return 3;
    }
    char *block = calloc(1, IO_BYTES);
    for (int i = 0; i < IO_FILE_BYTES / IO_BYTES; i++) {
        memset(block, 'a' + i % 26, IO_BYTES);
        if (write(fd, block, IO_BYTES) != IO_BYTES)
            return 3;
    }
    fsync(fd);
    close(fd);

    /* Mean block length for RATE blocks/s from procs*threads threads, and the
     * exponent that gives it: the mean of 2 + 48 u^a is 2 + 48 / (1 + a). */
    double mean_ms = rate > 0 ? 1000.0 * procs * threads / rate : (LO_MS + HI_MS) / 2;
    double lo = LO_MS + 0.05, hi = HI_MS - 0.05;
    mean_ms = mean_ms < lo ? lo : mean_ms > hi ? hi : mean_ms;
    shm->exponent = (HI_MS - LO_MS) / (mean_ms - LO_MS) - 1;

    signal(SIGINT, on_stop);
    signal(SIGTERM, on_stop);
    signal(SIGPIPE, SIG_IGN);
    struct spawner sp = {
        .self = self, .io_file = io_file, .shm_fd = shm_fd, .threads = threads, .variants = variants,
        .life_mean_s = churn > 0 ? procs / churn : 0, .driver = getpid(),
        .rng = mix((uint64_t)getpid() ^ (uint64_t)time(NULL)) | 1,
    };
    pid_t *pids = calloc((size_t)procs, sizeof(*pids));
    for (int s = 0; s < procs; s++)
        pids[s] = spawn(&sp, s, 1);
    printf("ready pid=%d paths=", getpid());
    for (int p = 0; p < NPATHS; p++)
        printf("%s%s", p ? "," : "", PATH_NAMES[p]);
    printf("\n");
    fflush(stdout);

    double t0 = now_s(), next_report = t0 + 1.0, last_t = t0;
    uint64_t per_path[NPATHS];
    uint64_t last_blocks = total_blocks(procs, per_path);
    while (!stopping) {
        struct timespec tick = { 0, 50000000L };
        nanosleep(&tick, NULL);
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            for (int s = 0; s < procs; s++) {
                if (pids[s] == pid) {
                    pids[s] = 0;
                    sp.exited++;
                    /* A killed worker leaves its threads and usage counted. */
                    __atomic_store_n(&shm->slots[s].threads, 0, __ATOMIC_RELAXED);
                    for (int u = 0; u < NUSE; u++)
                        __atomic_store_n(&shm->slots[s].use_live[u], 0, __ATOMIC_RELAXED);
                }
            }
        }
        for (int s = 0; s < procs && !stopping; s++)
            if (pids[s] <= 0)
                pids[s] = spawn(&sp, s, 0);
        double t = now_s();
        if (t < next_report)
            continue;
        next_report += 1.0;
        uint64_t blocks = total_blocks(procs, per_path);
        double measured = (double)(blocks - last_blocks) / (t - last_t);
        if (rate > 0 && measured > 0) {
            /* Blocks/s from T threads is about T / (mean block + overhead): move
             * the mean by the square root of the error (damped), within 2-50 ms. */
            double mean = LO_MS + (HI_MS - LO_MS) / (1 + shm->exponent);
            mean *= sqrt(measured / rate);
            mean = mean < lo ? lo : mean > hi ? hi : mean;
            shm->exponent = (HI_MS - LO_MS) / (mean - LO_MS) - 1;
        }
        last_blocks = blocks;
        last_t = t;
        int live = 0, nthreads = 0;
        for (int s = 0; s < procs; s++) {
            live += pids[s] > 0;
            nthreads += __atomic_load_n(&shm->slots[s].threads, __ATOMIC_RELAXED);
        }
        uint64_t use[NUSE];
        total_use(procs, use);
        printf("stats t=%.1f blocks=%llu voluntary=%llu involuntary=%llu cpu_us=%llu procs=%d started=%llu "
               "exited=%llu threads=%d mean_ms=%.2f paths=",
               t - t0, (unsigned long long)blocks, (unsigned long long)use[USE_VOLUNTARY],
               (unsigned long long)use[USE_INVOLUNTARY], (unsigned long long)use[USE_CPU_US], live,
               (unsigned long long)sp.started, (unsigned long long)sp.exited, nthreads,
               LO_MS + (HI_MS - LO_MS) / (1 + shm->exponent));
        for (int p = 0; p < NPATHS; p++)
            printf("%s%llu", p ? "," : "", (unsigned long long)per_path[p]);
        printf("\n");
        fflush(stdout);
    }
    for (int s = 0; s < procs; s++)
        if (pids[s] > 0)
            kill(pids[s], SIGKILL);
    while (wait(NULL) > 0)
        ;
    unlink(io_file);
    return 0;
}
