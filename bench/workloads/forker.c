/* fork + _exit + waitpid in a loop: the cost of offtop's probes on process creation.
 * Usage: forker N   prints "ns_per_fork X" after N forks. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 2000;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0)
            _exit(0);
        if (pid < 0 || waitpid(pid, NULL, 0) != pid)
            return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("ns_per_fork %.0f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
