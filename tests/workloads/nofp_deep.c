/* Built with -O2 -fomit-frame-pointer by the tests: a reader that blocks three
 * calls deep (offtop_nofp_f1 -> f2 -> f3 -> read), in code without frame
 * pointers, as Debian builds its programs.
 *
 *   nofp_deep MS   a writer thread writes a byte every MS ms (0: never, the
 *                  reader blocks for good); prints "ready pid=P tid=T" (T the reader).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int p[2];
static long ms;

__attribute__((noinline)) int offtop_nofp_f3(int fd)
{
    char c;
    int r = (int)read(fd, &c, 1);
    return r + 1;
}

__attribute__((noinline)) int offtop_nofp_f2(int fd)
{
    int r = offtop_nofp_f3(fd);
    return r * 3;
}

__attribute__((noinline)) int offtop_nofp_f1(int fd)
{
    int r = offtop_nofp_f2(fd);
    return r - 7;
}

static void *writer(void *arg)
{
    (void)arg;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    for (;;) {
        nanosleep(&ts, NULL);
        if (write(p[1], "x", 1) != 1)
            exit(1);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    ms = argc > 1 ? atol(argv[1]) : 0;
    if (pipe(p))
        return 1;
    printf("ready pid=%d tid=%ld\n", getpid(), (long)syscall(SYS_gettid));
    fflush(stdout);
    pthread_t t;
    if (ms > 0)
        pthread_create(&t, NULL, writer, NULL);
    long s = 0;
    for (;;)
        s += offtop_nofp_f1(p[0]);
    return (int)s;
}
