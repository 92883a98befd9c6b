/* Process creation in a loop: the cost of offtop's probes on it.
 * Usage: forker N [fork|exec|mmap]   prints "ns_per_op X" after N of:
 *   fork  fork + _exit + waitpid (the default);
 *   exec  fork + exec of /usr/bin/true + waitpid (an exec maps its program and
 *         libraries: the kernel's mapping records, offtop.bpf.sent_maps);
 *   mmap  mmap of /usr/bin/true's first page, executable, then munmap;
 *   data  the same page mapped readable only (a file's data), then munmap;
 *   anon  an anonymous page (what malloc maps), then munmap. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 2000;
    const char *what = argc > 2 ? argv[2] : "fork";
    int fd = open("/usr/bin/true", O_RDONLY);
    if (fd < 0)
        return 1;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        int anon = strcmp(what, "anon") == 0;
        if (strcmp(what, "mmap") == 0 || strcmp(what, "data") == 0 || anon) {
            int prot = PROT_READ | (strcmp(what, "mmap") == 0 ? PROT_EXEC : anon ? PROT_WRITE : 0);
            void *p = mmap(NULL, 4096, prot, MAP_PRIVATE | (anon ? MAP_ANONYMOUS : 0),
                           anon ? -1 : fd, 0);
            if (p == MAP_FAILED || munmap(p, 4096) != 0)
                return 1;
            continue;
        }
        pid_t pid = fork();
        if (pid == 0) {
            if (strcmp(what, "exec") == 0)
                execl("/usr/bin/true", "true", (char *)NULL);
            _exit(0);
        }
        if (pid < 0 || waitpid(pid, NULL, 0) != pid)
            return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("ns_per_op %.0f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
