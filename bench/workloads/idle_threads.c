/* N threads that block once and never wake: a thread pool idle for hours (a JVM's,
 * a database's). bench/idle_threads.py: what offtop costs while nothing happens. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t never = PTHREAD_COND_INITIALIZER;

static void *idle(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&lock);
    for (;;)
        pthread_cond_wait(&never, &lock);
    return NULL;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 5000;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 << 10);
    for (int i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, idle, NULL) != 0) {
            fprintf(stderr, "idle_threads: thread %d: cannot create\n", i);
            return 1;
        }
    }
    printf("ready %d\n", n);
    fflush(stdout);
    pause();
    return 0;
}
