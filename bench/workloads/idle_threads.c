/* N threads that block once and never wake: a thread pool idle for hours (a JVM's,
 * a database's). bench/idle_threads.py: what offtop costs while nothing happens.
 * `idle_threads N MS`: each thread wakes every MS milliseconds instead (a pool's
 * timed waits), the threads' wakeups spread over the period. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t never = PTHREAD_COND_INITIALIZER;

static long period_ms;

static void *idle(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;)
        pthread_cond_wait(&never, &lock);
    return NULL;
}

static void *timed(void *arg)
{
    long phase_ns = (long)arg;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_nsec += phase_ns;
    for (;;) {
        while (t.tv_nsec >= 1000000000L) {
            t.tv_nsec -= 1000000000L;
            t.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL);
        t.tv_sec += period_ms / 1000;
        t.tv_nsec += (period_ms % 1000) * 1000000L;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 5000;
    period_ms = argc > 2 ? atol(argv[2]) : 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 << 10);
    for (int i = 0; i < n; i++) {
        pthread_t t;
        void *phase = (void *)(period_ms * 1000000L / n * i);
        if (pthread_create(&t, &attr, period_ms > 0 ? timed : idle, phase) != 0) {
            fprintf(stderr, "idle_threads: thread %d: cannot create\n", i);
            return 1;
        }
    }
    printf("ready %d\n", n);
    fflush(stdout);
    pause();
    return 0;
}
