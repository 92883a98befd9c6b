/* Prints the offsets of offtop.pystacks.offsets.Layout for the CPython whose
 * headers it is compiled against, one "field value" a line:
 *
 *   gcc -I$INC -I$INC/internal -o offsets pystacks_offsets.c && ./offsets
 *
 * with INC the include directory of a CPython 3.8-3.13 (Include/ with its
 * internal/ headers, as `make install` and Debian's libpython3.X-dev ship
 * them). tests/test_pystacks.py compiles it against every header tree it
 * finds and compares with the tables; the tables were made with it.
 * Fields a version does not have are not printed. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#if PY_VERSION_HEX < 0x03090000
#include "internal/pycore_pystate.h"
#else
#include "internal/pycore_interp.h"
#include "internal/pycore_runtime.h"
#endif
#include "internal/pycore_gil.h"
#if PY_VERSION_HEX >= 0x030b0000
#include "internal/pycore_code.h"
#include "internal/pycore_frame.h"
#else
#include <frameobject.h>
#endif

#define P(name, val) printf("%s %ld\n", name, (long)(val))
#define END(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

int main(void) {
    P("runtime_interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX < 0x030c0000
    P("runtime_gil", offsetof(_PyRuntimeState, ceval.gil));
#else
    P("interp_gil_ptr", offsetof(PyInterpreterState, ceval.gil));
#endif
    P("interp_next", offsetof(PyInterpreterState, next));
#if PY_VERSION_HEX < 0x030b0000
    P("interp_threads_head", offsetof(PyInterpreterState, tstate_head));
#else
    P("interp_threads_head", offsetof(PyInterpreterState, threads.head));
#endif
    P("gil_last_holder", offsetof(struct _gil_runtime_state, last_holder));
    P("gil_locked", offsetof(struct _gil_runtime_state, locked));
    P("gil_size", sizeof(struct _gil_runtime_state));
    P("tstate_next", offsetof(PyThreadState, next));
    P("tstate_interp", offsetof(PyThreadState, interp));
    P("tstate_thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX < 0x030b0000
    P("tstate_frame", offsetof(PyThreadState, frame));
    P("frame_back", offsetof(PyFrameObject, f_back));
    P("frame_code", offsetof(PyFrameObject, f_code));
    P("frame_lasti", offsetof(PyFrameObject, f_lasti));
    P("frame_read", (MAX(END(PyFrameObject, f_back), MAX(END(PyFrameObject, f_code),
                                                         END(PyFrameObject, f_lasti))) + 7) / 8 * 8);
#else
    P("tstate_native_thread_id", offsetof(PyThreadState, native_thread_id));
#if PY_VERSION_HEX < 0x030d0000
    P("tstate_frame", offsetof(PyThreadState, cframe));
    P("cframe_current_frame", offsetof(_PyCFrame, current_frame));
    P("frame_instr", offsetof(_PyInterpreterFrame, prev_instr));
    P("frame_code", offsetof(_PyInterpreterFrame, f_code));
#else
    P("tstate_frame", offsetof(PyThreadState, current_frame));
    P("frame_instr", offsetof(_PyInterpreterFrame, instr_ptr));
    P("frame_code", offsetof(_PyInterpreterFrame, f_executable));
#endif
    P("frame_back", offsetof(_PyInterpreterFrame, previous));
    P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#if PY_VERSION_HEX < 0x030c0000
    P("frame_is_entry", offsetof(_PyInterpreterFrame, is_entry));
#endif
    /* Everything up to `owner` (the last field read), rounded up to 8. */
    P("frame_read", (END(_PyInterpreterFrame, owner) + 7) / 8 * 8);
    P("code_qualname", offsetof(PyCodeObject, co_qualname));
    P("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#endif
    P("code_filename", offsetof(PyCodeObject, co_filename));
    P("code_name", offsetof(PyCodeObject, co_name));
    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
#if PY_VERSION_HEX < 0x030a0000
    P("code_linetable", offsetof(PyCodeObject, co_lnotab));
#else
    P("code_linetable", offsetof(PyCodeObject, co_linetable));
#endif
    P("unicode_length", offsetof(PyASCIIObject, length));
    P("unicode_state", offsetof(PyASCIIObject, state));
    P("unicode_ascii_size", sizeof(PyASCIIObject));
    P("unicode_compact_size", sizeof(PyCompactUnicodeObject));
    P("bytes_size", offsetof(PyVarObject, ob_size));
    P("bytes_sval", offsetof(PyBytesObject, ob_sval));
    return 0;
}
