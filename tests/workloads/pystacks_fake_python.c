/* A process that looks like a CPython to offtop.pystacks but holds what the test writes.
 *
 * It exports the symbols the reader looks for (_PyRuntime, Py_Version and the
 * type objects; build with -rdynamic so they are in .dynsym) and fills a 1 MiB
 * arena, which is _PyRuntime itself, from stdin, one write a line:
 *
 *   OFFSET KIND VALUE     (OFFSET in hex, from the start of the arena)
 *
 *   u64 / u32 / u8 HEX    a number
 *   ptr HEX               the address of the arena plus HEX (a pointer into it)
 *   type NAME             the address of PyCode_Type, PyUnicode_Type,
 *                         PyBytes_Type or PyFrame_Type (code, unicode, bytes, frame)
 *   tid -                 this thread's kernel tid
 *   hex BYTES             raw bytes, e.g. ef04
 *   random LENGTH         LENGTH pseudo-random bytes (a fixed generator: deterministic)
 *   version HEX           sets Py_Version instead (OFFSET ignored)
 *
 * then prints "ready" and sleeps until killed. The tests build the image
 * with the reader's own layout tables: a well-formed one (the positive
 * control) and broken ones (loops, wrong types, garbage, huge lengths). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARENA (1u << 20)

__attribute__((aligned(4096))) unsigned char _PyRuntime[ARENA];
unsigned long Py_Version = 0x030b02f0; /* 3.11.2 */
__attribute__((aligned(64))) unsigned char PyCode_Type[416];
__attribute__((aligned(64))) unsigned char PyUnicode_Type[416];
__attribute__((aligned(64))) unsigned char PyBytes_Type[416];
__attribute__((aligned(64))) unsigned char PyFrame_Type[416];

static uint64_t type_address(const char *name) {
    if (!strcmp(name, "code")) return (uintptr_t)PyCode_Type;
    if (!strcmp(name, "unicode")) return (uintptr_t)PyUnicode_Type;
    if (!strcmp(name, "bytes")) return (uintptr_t)PyBytes_Type;
    if (!strcmp(name, "frame")) return (uintptr_t)PyFrame_Type;
    fprintf(stderr, "unknown type %s\n", name);
    exit(2);
}

int main(void) {
    char kind[16], value[4096];
    unsigned long off;
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    while (scanf("%lx %15s %4095s", &off, kind, value) == 3) {
        if (!strcmp(kind, "version")) {
            Py_Version = strtoul(value, NULL, 16);
            continue;
        }
        if (!strcmp(kind, "hex") || !strcmp(kind, "random")) {
            size_t n = !strcmp(kind, "hex") ? strlen(value) / 2 : strtoul(value, NULL, 16);
            if (off > ARENA || n > ARENA - off) return 2;
            for (size_t i = 0; i < n; i++) {
                unsigned int b;
                if (kind[0] == 'h') {
                    sscanf(value + 2 * i, "%2x", &b);
                } else {
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    b = (unsigned int)(seed >> 56);
                }
                _PyRuntime[off + i] = (unsigned char)b;
            }
            continue;
        }
        if (off > ARENA - 8) return 2;
        uint64_t v;
        size_t width = 8;
        if (!strcmp(kind, "ptr")) v = (uintptr_t)_PyRuntime + strtoull(value, NULL, 16);
        else if (!strcmp(kind, "type")) v = type_address(value);
        else if (!strcmp(kind, "tid")) v = (uint64_t)syscall(SYS_gettid);
        else {
            v = strtoull(value, NULL, 16);
            if (!strcmp(kind, "u32")) width = 4;
            else if (!strcmp(kind, "u8")) width = 1;
        }
        memcpy(_PyRuntime + off, &v, width); /* little-endian: the low bytes */
    }
    printf("ready\n");
    fflush(stdout);
    for (;;) pause();
}
