// offtop: off-CPU time from sched:sched_switch.
//
// At switch-out of a task in a recorded state, remember when and where it
// stopped (timestamp, state, stack ids, cgroup) in the task's own record. At
// switch-in of a task whose record holds a timestamp, the interval is
// `now - timestamp`, routed to exactly one of:
//   - >= offcpu_thresh_ns: one perf-buffer event built in a per-CPU payload;
//   - otherwise: summed (total, count, max) in the thread's own slot, or in an
//     in-kernel hash when its stacks or state differ from the slot's.
// Never both, so totals never double count (perf's --off-cpu-thresh design).
//
// This program reads the tracepoint's own fields and BPF helpers, and no
// kernel struct whose layout varies between kernels, so any kernel header
// tree compiles it for any kernel. (The one struct it reads, the user
// registers saved at kernel entry, has the layout x86-64's entry code fixes.)
//
// Cost: this runs on every context switch of the machine, so the common path
// is two array slots (next's record, prev's record), one clock read, sums in
// the slot, and no other helper call. Each thread keeps one record for its
// whole life (the timestamp is cleared, not the entry deleted, when it runs
// again), and whether a thread is ever recorded (kernel thread? offtop
// itself? outside -p/-t?) is decided once, at its first switch-out, and kept
// in that record. That is exact because these facts are fixed for a thread's
// life except across exec (a kernel thread that execs a user-mode helper, a
// non-leader thread that takes over the leader's pid): sched_process_exec
// drops the records involved, and sched_process_free drops a record once its
// task is gone, so a reused tid always starts afresh.
//
// Records live in an array indexed by tid (a hash lookup costs ~30 ns more
// per switch, twice): slot tid % OFFTOP_SLOTS, or one of the next SLOT_PROBES
// when taken by another live thread; a thread that finds none of them free
// goes to the small offcpu_start hash instead.
//
// bench/README.md has the measurements behind each of these choices.
//
// Compile-time knobs come from Python as -D integers, all validated there:
//   OFFTOP_STATE_MASK     states to record, as normalized prev_state bits
//   OFFTOP_KTHREADS       1: include kernel threads
//   OFFTOP_USER_STACKS    1: capture user stacks
//   OFFTOP_KERNEL_STACKS  1: capture kernel stacks
//   OFFTOP_FILTER_PID     1: only tgids in pid_filter (or tids in tid_filter)
//   OFFTOP_FILTER_TID     1: only tids in tid_filter (or tgids in pid_filter)
//   OFFTOP_FILTER_CGROUP  1: only tasks under cgroup_filter[0]
//   OFFTOP_SELF_TGID      offtop's own pid, never recorded (0: record it)
//   OFFTOP_STACK_ENTRIES, OFFTOP_USTACK_ENTRIES, OFFTOP_AGG_ENTRIES: map sizes
//   OFFTOP_SLOTS          per-thread record slots (offcpu_slots)
//   OFFTOP_KSTACK_DEPTH, OFFTOP_USTACK_DEPTH: frames kept per stack
//   OFFTOP_WAKERS         1: record who wakes each block (sched_waking)
//   OFFTOP_STACK_COPIES   1: send a stack's top bytes with a new user stack whose
//                         walk ended on a broken rbp chain (copy_stack)

// Normalized prev_state, as __trace_sched_switch_state() reports it: one bit
// per TASK_REPORT state; TASK_REPORT_MAX (0x100) means "preempted while
// runnable". Raw flags such as TASK_FREEZABLE never appear here, which is why
// offtop reads this field rather than task_struct->__state.
#define ST_S 0x01
#define ST_D 0x02
#define ST_R 0x100

// Counter slots (per-CPU, summed in Python): mirrored by decode.COUNTERS.
#define C_USTACK_EFAULT 0
#define C_USTACK_ENOMEM 1
#define C_USTACK_EEXIST 2
#define C_USTACK_OTHER 3
#define C_KSTACK_EFAULT 4
#define C_KSTACK_ENOMEM 5
#define C_KSTACK_EEXIST 6
#define C_KSTACK_OTHER 7
#define C_START_FULL 8
#define C_AGG_FULL 9
#define C_OUTPUT_FAIL 10
#define C_NO_START 11
#define C_RUNS 12       // sched_switch runs while armed
#define C_TIMED_RUNS 13 // of which timed (one in TIME_EVERY)
#define C_TIMED_NS 14   // and the time those took
#define C_END_UNSEEN 15 // blocks whose end (switch-in) went unseen: lost
#define C_MAX 16

// The probe counts its runs and times one in TIME_EVERY per CPU (a clock
// read and two counter adds), rather than through the kernel's BPF run-time
// statistics, a switch for the whole machine that makes every BPF program of
// every tool pay two clock reads per run while on (offtop.bpf.probe_stats).
#define TIME_EVERY 16

// offtop_config slots, written by Python.
#define CFG_GEN 0       // aggregate generation: counts up; its parity picks the maps
#define CFG_ARMED 1     // 1 once Python has written every map the program reads
#define CFG_CGROUP_GEN 2 // bumped by the program on every cgroup migration
#define CFG_WAKER_MIN 3  // take a waker's stacks only for blocks at least this long (ns)
#define CFG_ENTRY_LO 4   // the kernel's entry code, [lo, hi) (__entry_text_start/_end):
#define CFG_ENTRY_HI 5   //   where an interrupt's path begins (0, 0: not known yet)

// Who ended a block: the task that woke it, or an interrupt. Mirrored by
// decode.Waker. `what` is WAKER_* << 24 | the irq or softirq number.
#define WAKER_NONE 0        // not seen (offtop started while it was waking)
#define WAKER_TASK 1
#define WAKER_IRQ 2         // an interrupt (its kernel stack says which: timer, softirq, ...)
struct waker {
    u32 tgid;       // 0 for an interrupt
    u32 tid;
    s32 ustack;     // -1: not taken (shorter than CFG_WAKER_MIN, or no user context)
    s32 kstack;
    u32 what;
    u32 pad;
    char comm[16];
};

// One per thread seen switching out. Mirrored by decode.StartRecord (Python
// finds the claimed slots with decode.owned_slots). ts == 0: the
// thread is on a CPU, or was not recorded at its last switch-out (state not
// asked for, or skip). tid == 0: a free slot.
struct start_rec {
    u64 ts;
    u64 cgroup_id;
    u64 tid;        // a u64: bcc's LLVM emits 64-bit compare-and-swap only
    u32 tgid;
    u32 state;
    s32 ustack;
    s32 kstack;
    u32 skip;       // REC_* flags, decided at the thread's first switch-out
    u32 cg_gen;     // CFG_CGROUP_GEN when cgroup_id was read (~0: never)
    // The user registers at kernel entry, saved at switch-out (0: not taken).
    // A blocked thread's stack does not change until it runs again, so
    // Python unwinds it from these with the binaries' call-frame information.
    u64 upc;
    u64 usp;
    u64 ubp;
    struct waker w; // who woke it, set by sched_waking (w.what == 0: nobody yet)
};
#define REC_SKIP 1      // never recorded (kernel thread, offtop itself, outside -p/-t)
#define REC_NO_USER 2   // no user stack to walk (kernel thread, io_uring/vhost worker)
#define REC_SEEDED 4    // written by Python for a thread blocked before offtop started

// A state bit Python sets in records it seeds: the block began before
// offtop did. It travels with the block into its event or aggregate, so the
// block is counted once, whole, and marked.
#define ST_BEFORE_START 0x80000000

// A thread's short blocks of one generation, summed in its own slot while
// they keep the same state and stacks (the common case: a thread blocking in
// one place); the rest go to the aggregate hash. Mirrored by decode.AccRecord.
struct acc_rec {
    u32 tag;        // CFG_GEN + 1 of the generation it holds (0: never used)
    u32 tid;
    u32 tgid;
    u32 state;
    s32 ustack;
    s32 kstack;
    u64 total_ns;
    u64 max_ns;
    u64 count;
    char comm[16];
    struct waker w;
};

// Mirrored by decode.AggKey.
struct agg_key {
    u32 tgid;
    u32 tid;
    s32 ustack;
    s32 kstack;
    u32 state;
    u32 waker_tgid;     // who woke these blocks; their stacks are in agg_val:
    u32 waker_tid;      // keyed by them, interrupts (whose stacks run through
    u32 waker_what;     // whatever they interrupted) would split every row
};

// Mirrored by decode.AggValue.
struct agg_val {
    u64 total_ns;
    u64 max_ns;
    u64 count;
    char comm[16];
    char waker_comm[16];
    s32 waker_ustack;   // the waker's stacks at the latest of these blocks
    s32 waker_kstack;
};

// Mirrored by decode.OffcpuEvent.
struct offcpu_event {
    u64 end_ns;
    u64 delta_ns;
    u64 cgroup_id;
    u32 tgid;
    u32 tid;
    s32 ustack;
    s32 kstack;
    u32 state;
    u32 cpu;
    char comm[16];
    struct waker w;
};

struct kstack_t { u64 ip[OFFTOP_KSTACK_DEPTH]; };
struct ustack_t { u64 ip[OFFTOP_USTACK_DEPTH]; };

// The threshold, written from Python at any time (bcc 0.26 cannot load
// true BPF globals, so it is a one-slot array map of the global's name).
BPF_ARRAY(offcpu_thresh_ns, u64, 1);
BPF_ARRAY(offtop_config, u64, 6);

BPF_PERCPU_ARRAY(offtop_counters, u64, C_MAX);
BPF_PERCPU_ARRAY(offcpu_payload, struct offcpu_event, 1);
BPF_PERF_OUTPUT(offcpu_events);

BPF_TABLE("stacktrace", int, struct kstack_t, kernel_stacks, OFFTOP_STACK_ENTRIES);
#if defined(__x86_64__)
// User stacks are walked by this program (walk_user_stack below), and kept
// in a hash that Python reads exactly like a stack map: id -> frames. An id
// is a hash of the frames, so an id always names the same stack, and the
// map can be an LRU: the stacks no block has used for longest go first,
// never a new one (a full map would turn every new stack into -ENOMEM; as
// Python teaches unwinding rules, each site's stack grows by a frame or two
// and briefly exists in several versions).
BPF_TABLE("lru_hash", u32, struct ustack_t, user_stacks, OFFTOP_USTACK_ENTRIES);
// One frame longer than a stack, so the terminating 0 always has a place;
// the id in front: a new stack is also sent whole, id first (its process's
// tgid in the id's upper half), through new_user_stacks, so that Python has
// its frames without a lookup per id (one system call each: thousands a
// second under process churn) and even once the LRU has evicted it (Python
// falls back to the map when a record was lost).
//
// A new stack whose walk ended on a broken rbp chain (code without frame
// pointers, whose rules Python has not taught yet) is sent with the top
// STACK_COPY bytes of its user stack and the registers the walk began from
// (`copy` below; USTACK_COPIED set in the id): Python unwinds that copy with
// the binaries' call-frame information and teaches the probe every rule the
// stack needs at once, so the site's next walk is whole. (Without it, each
// walk reveals one frame more: Debian's gzip took 9 sightings.) Copies are
// paced per CPU (COPY_GAP_NS apart), so a start on a busy machine does not
// flood the ring with them; a stack sent without one is learned as before.
#define STACK_COPY 4096
#define COPY_GAP_NS 8000000ULL
#define USTACK_COPIED (1ULL << 31)      // in a record's id: a copy follows
// bytes[] is twice what is sent, so that the verifier can prove the second
// read in bounds (it bounds its offset and its length apart, not their sum).
struct stack_copy { u64 sp; u64 bp; u64 len; u8 bytes[2 * STACK_COPY]; };
struct ustack_scratch_t { u64 id; u64 ip[OFFTOP_USTACK_DEPTH + 1]; struct stack_copy copy; };
BPF_PERCPU_ARRAY(ustack_scratch, struct ustack_scratch_t, 1);
// When this CPU last sent a copy (ns).
BPF_PERCPU_ARRAY(ustack_copied_at, u64, 1);
BPF_PERF_OUTPUT(new_user_stacks);
// The walk's frame count, passed through memory: see walk_user_stack().
BPF_PERCPU_ARRAY(ustack_len, u64, 1);
#else
BPF_TABLE("stacktrace", int, struct ustack_t, user_stacks, OFFTOP_USTACK_ENTRIES);
#endif

#if OFFTOP_USER_STACKS && defined(__x86_64__)
// How to step from a frame to its caller, per process and pc, taught by
// Python from the binaries' call-frame information (.eh_frame): the probe
// unwinds user stacks with these where it has them and along the rbp chain
// where it has not (see walk_user_stack). A pc's rule is keyed by the pc
// itself for a thread's first frame and by the return address for callers
// (Python computes those at address - 1). LRU: processes come and go, and
// Python deletes the rules of a process once it is gone.
struct rule_key {
    u32 tgid;
    u32 pad;
    u64 pc;
};
// A rule, packed: kind (bits 0-7), CFA offset (8-23), where the return
// address is relative to the CFA (24-39), where rbp is saved relative to
// the CFA or RULE_BP_SAME (40-55).
#define RULE_RSP 1          // CFA = rsp + offset
#define RULE_RBP 2          // CFA = rbp + offset
#define RULE_OUTERMOST 3    // no caller: the stack is complete
#define RULE_FP 4           // no usable rule: take a frame-pointer step
#define RULE_BP_SAME 0x7fff // rbp keeps its value in the caller
BPF_TABLE("lru_hash", struct rule_key, u64, unwind_rules, 65536);
// A process forked (and not exec'd since) that offtop has not seen yet walks by
// the rules of the process it was forked from: its memory is a copy of that
// one's. Written at the fork (sched_process_fork: the forker's own owner if it
// has one), deleted at exec and by Python once it has taught the process rules
// of its own, or once the owner is gone (its pid may come back as another
// process). One lookup a walk, of a map that holds only such processes (and,
// until reused or evicted, the threads created since: the tracepoint does not
// tell a thread from a process).
BPF_TABLE("lru_hash", u32, u32, rules_owner, 8192);
// Bit 63 (never set in a user address) marks a frame reached along the rbp
// chain rather than by a rule: Python keeps it only if the frame below it
// keeps rbp as its frame base.
#define FP_FRAME_TAG (1ULL << 63)
#endif

// Per-thread records (see start_rec and the top of this file). Mappable, so
// Python reads blocked-now from it without a system call per slot. A slot is
// claimed with a compare-and-swap on its tid (two threads whose slots
// collide may switch out at once on two CPUs), and freed by
// sched_process_free; Python frees any that a missed event left behind.
#define SLOT_PROBES 4
BPF_F_TABLE("array", u32, struct start_rec, offcpu_slots, OFFTOP_SLOTS, BPF_F_MMAPABLE);
// A byte per slot, 1 while it is claimed: Python finds the claimed slots by
// searching these bytes (memchr speed, as with offcpu_touched) rather than by
// walking every slot's tid (65,536 words: 1.6-3.6 ms of Python per snapshot).
// Set after the claim, cleared before the release: x86-64 makes one CPU's
// stores visible in order and the claim is a locked compare-and-swap, so a
// slot claimed again at once ends with its byte set.
BPF_F_TABLE("array", u32, u64, offcpu_slot_taken, OFFTOP_SLOTS / 8, BPF_F_MMAPABLE);
// Threads that found no free slot among their SLOT_PROBES.
// Also where Python seeds the records of threads blocked before it started.
BPF_HASH(offcpu_start, u32, struct start_rec, 16384);
#define NO_SLOT 0xffffffff

// Per-slot sums of short blocks, two per slot (index slot * 2 + generation
// parity): the program fills the current generation's while Python reads the
// previous one's, exactly as with offcpu_agg0/1 below. Mapped, so Python
// reads a generation with one pass over memory.
BPF_F_TABLE("array", u32, struct acc_rec, offcpu_acc, OFFTOP_SLOTS * 2, BPF_F_MMAPABLE);
// Which slots' sums a generation holds: one byte per slot and parity (byte
// parity * OFFTOP_SLOTS + slot), set where the program starts a slot's sums
// for a generation. Python finds a generation's sums by searching its
// OFFTOP_SLOTS bytes (a few tens of microseconds), not by walking every
// slot's record (megabytes of memory, a millisecond, at every read), and
// zeroes them once read. Plain byte stores: no two CPUs write one slot's byte.
// One word more: its byte `parity` is set where the program adds a key to
// offcpu_agg<parity> (any CPU may, all store 1), so that Python skips reading
// a generation's hash when nothing went there (the usual case on a quiet
// machine: the batch read walks every bucket, ~0.3 ms four times a second).
#define TOUCHED_WORDS (OFFTOP_SLOTS * 2 / 8)
#define AGG_USED_WORD TOUCHED_WORDS
BPF_F_TABLE("array", u32, u64, offcpu_touched, TOUCHED_WORDS + 1, BPF_F_MMAPABLE);

// Two generations of aggregates: the program writes the one offtop_config
// [CFG_GEN] names while Python drains the other, so no increment is ever lost
// to a read-and-clear race.
BPF_HASH(offcpu_agg0, struct agg_key, struct agg_val, OFFTOP_AGG_ENTRIES);
BPF_HASH(offcpu_agg1, struct agg_key, struct agg_val, OFFTOP_AGG_ENTRIES);

#if OFFTOP_FILTER_PID || OFFTOP_FILTER_TID
BPF_HASH(pid_filter, u32, u8, 4096);
BPF_HASH(tid_filter, u32, u8, 4096);
#endif
#if OFFTOP_FILTER_CGROUP
BPF_CGROUP_ARRAY(cgroup_filter, 1);
#endif

static __always_inline void count(u32 slot)
{
    u64 *c = offtop_counters.lookup(&slot);
    if (c)
        (*c)++;
}

static __always_inline void count_stack_error(int err, u32 base)
{
    // base is C_USTACK_EFAULT or C_KSTACK_EFAULT; the three causes follow it.
    if (err == -14)         // EFAULT: no stack to walk (e.g. no user context)
        count(base);
    else if (err == -12)    // ENOMEM: stack map full
        count(base + 1);
    else if (err == -17)    // EEXIST: hash bucket taken by another stack
        count(base + 2);
    else
        count(base + 3);
}

static __always_inline u32 normalize_state(long prev_state)
{
    u32 st = prev_state & 0x1ff;
    if (st == 0 || (st & ST_R))
        return ST_R;
    return st;
}

// The record of `tid` and its slot index (NO_SLOT: in the overflow hash).
static __always_inline struct start_rec *find_rec_at(u32 tid, u32 *slot)
{
#pragma unroll
    for (u32 i = 0; i < SLOT_PROBES; i++) {
        u32 idx = (tid + i) % OFFTOP_SLOTS;
        struct start_rec *r = offcpu_slots.lookup(&idx);
        if (r && r->tid == tid) {
            *slot = idx;
            return r;
        }
    }
    *slot = NO_SLOT;
    return offcpu_start.lookup(&tid);
}

// offcpu_slot_taken's byte of slot `idx`.
static __always_inline void mark_slot(u32 idx, u8 taken)
{
    u32 wi = idx / 8;
    u64 *w = offcpu_slot_taken.lookup(&wi);
    if (w)
        ((u8 *)w)[idx % 8] = taken;
}

// A free slot near `tid`, claimed for it (NULL: none free).
static __always_inline struct start_rec *claim_slot(u32 tid)
{
#pragma unroll
    for (u32 i = 0; i < SLOT_PROBES; i++) {
        u32 idx = (tid + i) % OFFTOP_SLOTS;
        struct start_rec *r = offcpu_slots.lookup(&idx);
        if (r && r->tid == 0 && __sync_val_compare_and_swap(&r->tid, 0, (u64)tid) == 0) {
            mark_slot(idx, 1);
            return r;
        }
    }
    return NULL;
}

// A record for a thread that has none (find_rec() said so; only the thread
// itself, switching out, creates its record, so it cannot appear meanwhile).
static __always_inline struct start_rec *new_rec(u32 tid)
{
    struct start_rec *r = claim_slot(tid);
    if (r)
        return r;
    struct start_rec init = {};
    init.tid = tid;
    if (offcpu_start.insert(&tid, &init) != 0)
        return NULL;
    return offcpu_start.lookup(&tid);
}

static __always_inline void drop_rec(u32 tid)
{
#pragma unroll
    for (u32 i = 0; i < SLOT_PROBES; i++) {
        u32 idx = (tid + i) % OFFTOP_SLOTS;
        struct start_rec *r = offcpu_slots.lookup(&idx);
        if (r && r->tid == tid) {
            r->ts = 0;
            mark_slot(idx, 0);
            // Release last: a thread may claim the slot as soon as it reads 0.
            __sync_val_compare_and_swap(&r->tid, (u64)tid, 0);
        }
    }
    offcpu_start.delete(&tid);
}

// REC_* flags of a thread, decided once, at its first switch-out (see top).
static __always_inline u32 classify(void *args, u32 tgid, u32 tid)
{
    u32 flags = 0;
#if OFFTOP_SELF_TGID
    if (tgid == OFFTOP_SELF_TGID)
        flags |= REC_SKIP;
#endif
#if OFFTOP_FILTER_PID || OFFTOP_FILTER_TID
    if (!pid_filter.lookup(&tgid) && !tid_filter.lookup(&tid))
        flags |= REC_SKIP;
#endif
#if !OFFTOP_KTHREADS || OFFTOP_USER_STACKS
    // One user frame, by the kernel's own walker: kernel threads (and
    // io_uring/vhost workers, which the kernel treats alike) have none, every
    // user thread has its ip.
    u64 ip = 0;
    if (bpf_get_stack(args, &ip, sizeof(ip), BPF_F_USER_STACK) <= 0) {
        flags |= REC_NO_USER;
#if !OFFTOP_KTHREADS
        flags |= REC_SKIP;
#endif
    }
#endif
    return flags;
}

#if OFFTOP_USER_STACKS && defined(__x86_64__)
// The top of a user stack from `sp` up, into `st->copy`: to the end of sp's
// page, then the next page's start while it is mapped (a stack's top may be
// the page above). False when paced out or nothing could be read.
static __always_inline bool copy_stack(struct ustack_scratch_t *st, u64 sp, u64 bp)
{
    u32 zero = 0;
    u64 *at = ustack_copied_at.lookup(&zero);
    u64 now = bpf_ktime_get_ns();
    if (!at || now - *at < COPY_GAP_NS)
        return false;
    u64 first = STACK_COPY - (sp & (STACK_COPY - 1));  // 1..STACK_COPY, to the page's end
    if (first > STACK_COPY || first == 0)
        return false;
    if (bpf_probe_read_user(st->copy.bytes, first, (void *)sp) != 0)
        return false;
    u64 len = first;
    u64 rest = STACK_COPY - first;
    if (rest > 0 && rest < STACK_COPY &&
        bpf_probe_read_user(st->copy.bytes + first, rest, (void *)(sp + first)) == 0)
        len = STACK_COPY;
    *at = now;
    st->copy.sp = sp;
    st->copy.bp = bp;
    st->copy.len = len;
    return true;
}

// The user stack of the current thread, by its frame-pointer chain, as an id
// in user_stacks (or -EFAULT/-EEXIST/-ENOMEM, as bpf_get_stackid() returns).
//
// Why not bpf_get_stackid(): the kernel's walker (perf_callchain_user) reads
// frame after frame until a read faults or fp is 0, and glibc's start code
// leaves argc in rbp below main's frame, so every walk of a main thread ended
// by dereferencing a small integer: a page fault taken through the exception
// tables, measured at ~0.75 us of a ~0.9 us walk. This walk is the same chain
// (ip, then the return address of each frame) but stops, without touching
// memory, at a frame pointer no frame can have: below the first page
// (mmap_min_addr), not 8-byte aligned, or past the user address space.
// 32-bit tasks go to the kernel's walker.
static __always_inline int walk_user_stack(void *args, u32 tgid, struct start_rec *rec)
{
    u32 zero = 0;
    struct ustack_scratch_t *st = ustack_scratch.lookup(&zero);
    if (!st)
        return -12;
    // The user registers saved at kernel entry (x86-64 struct pt_regs, whose
    // layout entry_64.S fixes: bp at 32, ip at 128, cs at 136, sp at 152).
    struct task_struct *task = bpf_get_current_task_btf();
    char *regs = (char *)bpf_task_pt_regs(task);
    u64 ip_cs[4] = {}, fp = 0;     // ip, cs, flags, sp
    bpf_probe_read_kernel(ip_cs, sizeof(ip_cs), regs + 128);
    bpf_probe_read_kernel(&fp, sizeof(fp), regs + 32);
    if ((ip_cs[1] & 3) != 3 || ip_cs[0] == 0)
        return -14;             // not user mode: nothing to walk
    if (rec) {
        rec->upc = ip_cs[0];
        rec->usp = ip_cs[3];
        rec->ubp = fp;
    }
    // The id is a hash of the frames, mixed in as they are read.
    u64 h = 0x9E3779B97F4A7C15ULL;
    u32 n;
    bool broken = false;        // ended on an rbp chain that cannot be a frame's
    if (ip_cs[1] != 0x33) {     // not __USER_CS: a 32-bit task
        long bytes = bpf_get_stack(args, st->ip, sizeof(struct ustack_t), BPF_F_USER_STACK);
        if (bytes <= 0)
            return -14;
        n = (u64)bytes / 8;
        h ^= n;                 // rare: a weaker id, still checked below
    } else {
        st->ip[0] = ip_cs[0];
        h = (h ^ ip_cs[0]) * 0x100000001B3ULL;
        n = 1;
        u64 pc = ip_cs[0], sp = ip_cs[3], bp = fp;
        struct rule_key rk = {};
        u32 *owner = rules_owner.lookup(&tgid);
        rk.tgid = owner ? *owner : tgid;
        for (u32 i = 1; i < OFFTOP_USTACK_DEPTH; i++) {
            rk.pc = pc;
            u64 *rule = unwind_rules.lookup(&rk);
            u32 kind = rule ? (u32)(*rule & 0xff) : RULE_FP;
            u64 ra, tag = 0;
            if (kind == RULE_OUTERMOST) {
                break;
            } else if (kind == RULE_RSP || kind == RULE_RBP) {
                s64 cfa_off = (s16)(*rule >> 8);
                s64 ra_off = (s16)(*rule >> 24);
                s64 bp_off = (s16)(*rule >> 40);
                u64 cfa = (kind == RULE_RSP ? sp : bp) + cfa_off;
                if (bpf_probe_read_user(&ra, sizeof(ra), (void *)(cfa + ra_off)) != 0)
                    break;
                if (bp_off != RULE_BP_SAME &&
                    bpf_probe_read_user(&bp, sizeof(bp), (void *)(cfa + bp_off)) != 0)
                    bp = 0;
                sp = cfa;
            } else {
                // No rule known (yet): one step along the rbp chain, stopped
                // without touching memory at a frame pointer no frame can
                // have (below the first page, unaligned, past user space).
                if (bp < 4096 || (bp & 7) || bp > 0x00007fffffffeff0ULL) {
                    // 0 is how the outermost frame ends the chain (_start and
                    // clone clear rbp), but not within a stack's first two
                    // frames: code without frame pointers holds 0 there too.
                    broken = bp != 0 || i <= 2;
                    break;
                }
                u64 frame[2];       // saved rbp, return address
                if (bpf_probe_read_user(frame, sizeof(frame), (void *)bp) != 0) {
                    broken = true;
                    break;
                }
                ra = frame[1];
                sp = bp + 16;
                bp = frame[0];
                tag = FP_FRAME_TAG;
            }
            if (ra == 0)
                break;
            st->ip[i] = ra | tag;
            // The id hashes addresses only: where frame pointers are kept,
            // the rbp chain and the rules find the same frames, and a stack
            // must keep its id as Python teaches rules (else each step of
            // learning would store every stack again).
            h = (h ^ ra) * 0x100000001B3ULL;
            h ^= h >> 29;
            n = i + 1;
            pc = ra;
        }
    }
    // The verifier follows the walk loop once per way out of it, each with
    // its own constant n, and would check everything below once per n (and
    // the compare loop up to n times each): ~0.3 s more to load. Read back
    // from a map, n is one unknown value and all those ways out are one.
    u64 *len = ustack_len.lookup(&zero);
    if (!len)
        return -12;
    *(volatile u64 *)len = n;
    u64 frames = *(volatile u64 *)len;
    if (frames > OFFTOP_USTACK_DEPTH)
        return -22;
    st->ip[frames] = 0;         // Python reads a stack up to its first 0
    // The id is 31 bits of the hash (a hash map's keys need not be small,
    // unlike a stack map's): two distinct stacks meet under one id about
    // once in 10^5 pairs at 20,000 stacks, and then the second is -EEXIST
    // (counted), never a wrong answer.
    u32 id = (u32)(h >> 33);
    struct ustack_t *have = user_stacks.lookup(&id);
    if (!have) {
        int err = user_stacks.insert(&id, (struct ustack_t *)st->ip);
        if (err == 0) {
            st->id = id | ((u64)tgid << 32);   // whose it is: resolved while it lives
            // Not for a waker's stack (rec NULL): wakers are anyone, outside
            // -p/-c too, and their rules would take the budget of those watched.
            if (OFFTOP_STACK_COPIES && rec && broken && copy_stack(st, ip_cs[3], fp)) {
                st->id |= USTACK_COPIED;
                new_user_stacks.perf_submit(args, st, sizeof(*st) - STACK_COPY);
            } else {
                new_user_stacks.perf_submit(args, st, 8 + frames * 8);   // frames <= DEPTH
            }
            return id;
        }
        have = user_stacks.lookup(&id);     // inserted meanwhile on another CPU?
        if (!have)
            return err == -17 ? -17 : -12;
    }
    // Frames 0..n-1 and the terminating 0 must match (their addresses: the
    // stored stack keeps the tags it was first seen with).
    for (u32 i = 0; i < OFFTOP_USTACK_DEPTH; i++) {
        u64 a = st->ip[i], b = have->ip[i];
        if ((a ^ b) & ~FP_FRAME_TAG)
            return -17;
        if (i >= frames)
            break;
    }
    return id;
}
#endif

// A block of thread `tid` from `start` to `now` (its record `rec`, whose
// timestamp is already cleared), routed to exactly one of: a perf event (at
// or above the threshold), the thread's slot sums, the aggregate hash. An
// event the perf buffer has no room for (offtop fell behind, or a burst
// outran it) is summed as a shorter block would be: its time and its stacks
// are kept, only its detail as a long block is lost (counted, and the
// kernel's own LOST record says so too).
static __always_inline void account_block(void *args, u32 tid, u32 slot, struct start_rec *rec,
                                          u64 start, u64 now, const char *comm)
{
    u64 delta = now - start;
    u32 zero = 0;
    u64 *thresh = offcpu_thresh_ns.lookup(&zero);
    if (thresh && delta >= *thresh) {
        struct offcpu_event *ev = offcpu_payload.lookup(&zero);
        if (!ev)
            return;
        ev->end_ns = now;
        ev->delta_ns = delta;
        ev->cgroup_id = rec->cgroup_id;
        ev->tgid = rec->tgid;
        ev->tid = tid;
        ev->ustack = rec->ustack;
        ev->kstack = rec->kstack;
        ev->state = rec->state;
        ev->cpu = bpf_get_smp_processor_id();
        ev->w = rec->w;
        bpf_probe_read_kernel(&ev->comm, sizeof(ev->comm), comm);
        if (offcpu_events.perf_submit(args, ev, sizeof(*ev)) == 0)
            return;
        count(C_OUTPUT_FAIL);
    }

    u32 gen_slot = CFG_GEN;
    u64 *gen = offtop_config.lookup(&gen_slot);
    u64 g = gen ? *gen : 0;
    // A task runs on one CPU at a time and its tid is in both the slot sums
    // and the hash key, so plain (non-atomic) updates never race.
    if (slot != NO_SLOT) {
        u32 ai = slot * 2 + (u32)(g & 1);
        struct acc_rec *a = offcpu_acc.lookup(&ai);
        if (a) {
            u32 tag = (u32)g + 1;
            if (a->tag != tag) {
                // Free for this generation: it holds one two generations old,
                // which Python read during the last one (or nothing).
                a->tid = tid;
                a->tgid = rec->tgid;
                a->state = rec->state;
                a->ustack = rec->ustack;
                a->kstack = rec->kstack;
                a->total_ns = delta;
                a->max_ns = delta;
                a->count = 1;
                a->w = rec->w;
                bpf_probe_read_kernel(&a->comm, sizeof(a->comm), comm);
                a->tag = tag;
                u32 mark = (u32)(g & 1) * OFFTOP_SLOTS + slot;
                u32 wi = mark / 8;
                u64 *w = offcpu_touched.lookup(&wi);
                if (w)
                    ((u8 *)w)[mark % 8] = 1;
                return;
            }
            if (a->tid == tid && a->state == rec->state && a->ustack == rec->ustack &&
                a->kstack == rec->kstack && a->w.tid == rec->w.tid &&
                a->w.tgid == rec->w.tgid && a->w.what == rec->w.what) {
                a->w.ustack = rec->w.ustack;
                a->w.kstack = rec->w.kstack;
                a->total_ns += delta;
                a->count += 1;
                if (delta > a->max_ns)
                    a->max_ns = delta;
                return;
            }
        }
    }

    struct agg_key key = {};
    key.tgid = rec->tgid;
    key.tid = tid;
    key.ustack = rec->ustack;
    key.kstack = rec->kstack;
    key.state = rec->state;
    key.waker_tgid = rec->w.tgid;
    key.waker_tid = rec->w.tid;
    key.waker_what = rec->w.what;

    struct agg_val *val;
    bool added = false;
    if (g & 1) {
        val = offcpu_agg1.lookup(&key);
        if (!val) {
            struct agg_val init = {};
            bpf_probe_read_kernel(&init.comm, sizeof(init.comm), comm);
            __builtin_memcpy(init.waker_comm, rec->w.comm, sizeof(init.waker_comm));
            offcpu_agg1.insert(&key, &init);
            val = offcpu_agg1.lookup(&key);
            added = true;
        }
    } else {
        val = offcpu_agg0.lookup(&key);
        if (!val) {
            struct agg_val init = {};
            bpf_probe_read_kernel(&init.comm, sizeof(init.comm), comm);
            __builtin_memcpy(init.waker_comm, rec->w.comm, sizeof(init.waker_comm));
            offcpu_agg0.insert(&key, &init);
            val = offcpu_agg0.lookup(&key);
            added = true;
        }
    }
    if (added) {
        // Marked on insert only: a key is in a generation's map only if it was
        // added since Python last read and cleared that map (and its mark,
        // after the flip, when nothing writes it any more).
        u32 used_word = AGG_USED_WORD;
        u64 *used = offcpu_touched.lookup(&used_word);
        if (used)
            ((u8 *)used)[g & 1] = 1;
    }
    if (!val) {
        count(C_AGG_FULL);
        return;
    }
    val->total_ns += delta;
    val->count += 1;
    val->waker_ustack = rec->w.ustack;
    val->waker_kstack = rec->w.kstack;
    if (delta > val->max_ns)
        val->max_ns = delta;
}

static __always_inline void on_switch_out(void *args, u32 tid, long prev_state, u64 now)
{
    // tid is the tracepoint's prev_pid (prev is current here): no helper call.
    if (tid == 0)
        return;
    // Every thread that switches out gets its record, whatever its state, so
    // that its switch-ins find it in its slot rather than miss and look in
    // the overflow hash.
    u32 slot;
    struct start_rec *rec = find_rec_at(tid, &slot);
    if (rec && slot == NO_SLOT && (rec->skip & REC_SEEDED)) {
        // Python seeded this record in the overflow hash (the thread was
        // blocked before offtop started; that block was counted when it
        // ran again). Move it to a slot, where its switches are cheaper.
        struct start_rec *moved = claim_slot(tid);
        if (moved) {
            moved->ts = 0;
            moved->tgid = rec->tgid;
            moved->skip = rec->skip & ~REC_SEEDED;
            moved->cg_gen = ~0U;
            offcpu_start.delete(&tid);
            rec = moved;
        } else {
            rec->skip &= ~REC_SEEDED;
        }
    }
    if (!rec) {
        rec = new_rec(tid);
        if (!rec) {
            count(C_START_FULL);
            return;
        }
        // A thread's tgid is fixed for its life; exec's de_thread, which moves
        // a thread to another pid, drops the record (sched_process_exec).
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        rec->ts = 0;
        rec->tgid = tgid;
        rec->cg_gen = ~0U;
        rec->skip = classify(args, tgid, tid);
    }
    if (rec->skip & REC_SKIP)
        return;
    if (rec->ts) {
        // The thread ran, yet its record still holds the start of a block:
        // the switch-in that ended it went unseen. The kernel runs
        // sched_switch without BPF programs while one is already running on
        // that CPU (its recursion guard), and some kernels run no BPF program
        // while tasks they hide from tracing are current (seen here: a
        // sandbox's agent threads; a thread switched in from one is unseen).
        // Its end is not known: the block is lost, and counted. (Left, the
        // start would make a preemption next count the time the thread ran
        // as blocked.)
        rec->ts = 0;
        count(C_END_UNSEEN);
    }
    u32 state = normalize_state(prev_state);
    if (!(state & OFFTOP_STATE_MASK))
        return;
#if OFFTOP_FILTER_CGROUP
    // Not cached: a task can be moved to another cgroup at any time.
    if (cgroup_filter.check_current_task(0) != 1)
        return;
#endif

    s32 ustack = -1, kstack = -1;
    rec->upc = 0;
#if OFFTOP_USER_STACKS
    if (rec->skip & REC_NO_USER)
        ustack = -14;
    else
#if defined(__x86_64__)
        ustack = walk_user_stack(args, rec->tgid, rec);
#else
        ustack = user_stacks.get_stackid(args, BPF_F_USER_STACK);
#endif
    if (ustack < 0)
        count_stack_error(ustack, C_USTACK_EFAULT);
#endif
#if OFFTOP_KERNEL_STACKS
    kstack = kernel_stacks.get_stackid(args, 0);
    if (kstack < 0)
        count_stack_error(kstack, C_KSTACK_EFAULT);
#endif

    // Only this thread's own switches write its record, and a thread is
    // switched in only after its switch-out completed (under the runqueue
    // lock), so plain stores suffice. ts goes last: Python's blocked-now
    // reader treats a record with a timestamp as complete.
    rec->state = state;
    rec->ustack = ustack;
    rec->kstack = kstack;
    rec->w.what = WAKER_NONE;
    // A thread's cgroup changes only by migration, and every migration bumps
    // CFG_CGROUP_GEN after it is done (see the cgroup hooks below): a cgroup
    // id read under the current generation is still the thread's. The
    // generation is read before the id, so a migration racing with this
    // switch-out at worst makes the next one read the id again.
    u32 cg_slot = CFG_CGROUP_GEN;
    u64 *cg_gen = offtop_config.lookup(&cg_slot);
    u32 g = cg_gen ? (u32)*cg_gen : ~0U;
    if (rec->cg_gen != g || g == ~0U) {
        rec->cgroup_id = bpf_get_current_cgroup_id();
        rec->cg_gen = g;
    }
    rec->ts = now;
}

static __always_inline void on_switch_in(void *args, u32 tid, const char *next_comm, u64 now)
{
    if (tid == 0)
        return;
    u32 slot;
    struct start_rec *rec = find_rec_at(tid, &slot);
    if (!rec || rec->ts == 0)
        return;
    u64 start = rec->ts;
    rec->ts = 0;
    if (now < start)
        return;
    // The record is read on: only this thread's own switches write it, and
    // its waker was set before it could run.
    account_block(args, tid, slot, rec, start, now, next_comm);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    // bcc attaches the program as it loads it, before Python has written the
    // threshold and the -p/-t filters; a thread classified in that window
    // would keep the wrong answer, so nothing is recorded until then.
    u32 armed_slot = CFG_ARMED;
    u64 *armed = offtop_config.lookup(&armed_slot);
    if (!armed || !*armed)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u32 runs_slot = C_RUNS;
    u64 *runs = offtop_counters.lookup(&runs_slot);
    u64 run = 1;
    if (runs)
        run = (*runs)++;
    on_switch_in(args, args->next_pid, args->next_comm, now);
    on_switch_out(args, args->prev_pid, args->prev_state, now);
    if (run % TIME_EVERY == 0) {
        u64 took = bpf_ktime_get_ns() - now;
        u32 ns_slot = C_TIMED_NS;
        u64 *ns = offtop_counters.lookup(&ns_slot);
        if (ns)
            *ns += took;
        count(C_TIMED_RUNS);
    }
    return 0;
}

#if OFFTOP_WAKERS
// sched_waking runs in whatever context wakes the task, and in an interrupt
// the current task is just whoever was interrupted, not the waker. On
// x86-64 interrupts (and the softirqs run as they return) use a per-CPU
// interrupt stack, not the task's own, and a BPF program's frame lives on
// whichever stack is in use: outside the current task's stack, whose top is
// just above its saved user registers, it runs in an interrupt. (Softirqs
// run by ksoftirqd are that thread's work: it is named as the waker, and
// its kernel stack shows the softirq.)
//
// A program with a large frame may get a private, per-CPU stack (kernel
// 6.13+), which would say nothing, so this check is a program of its own
// with a tiny frame, attached to sched_waking (by bcc, as it loads), which
// then tail-calls on_sched_waking (put in waking_next by Python once
// loaded): on the same CPU, with interrupts as they were, and without a
// second program run through the tracepoint (measured: ~140 ns a wakeup
// for an empty program run that way). The answer is handed over per CPU,
// tagged with the wakee. Other architectures: every waker is taken for a
// task.
#define KERNEL_STACK_SIZE 16384
#define PT_REGS_SIZE 168
struct waking_ctx {
    u32 wakee;
    u32 irq;
};
BPF_PERCPU_ARRAY(waking_now, struct waking_ctx, 1);
BPF_PROG_ARRAY(waking_next, 2);  // [0]: on_sched_waking, [1]: on_irq_waker

// Whether this sched_waking runs in an interrupt; `frame` is the address of a
// local of the calling program (where its frame is).
static __always_inline u32 waking_in_irq(u64 frame)
{
#if defined(__x86_64__)
    struct task_struct *task = bpf_get_current_task_btf();
    char *regs = (char *)bpf_task_pt_regs(task);
    u64 top = (u64)regs + PT_REGS_SIZE;
    if (frame >= top || frame < top - KERNEL_STACK_SIZE)
        return 1;
    // On the task's stack, but an interrupt that came from user mode runs
    // there too (there is nothing below it to protect): then the registers
    // at the top are the interrupt's, not a system call's. A system call in
    // progress has its number in orig_ax and -ENOSYS in ax (do_syscall_64
    // sets it first); an interrupt leaves the user's ax there.
    // (One word at a time: the frame must stay small, see above.)
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), regs + 136);      // cs
    if ((v & 3) != 3)
        return 0;
    bpf_probe_read_kernel(&v, sizeof(v), regs + 120);      // orig_ax
    if ((s64)v < 0)
        return 1;
    bpf_probe_read_kernel(&v, sizeof(v), regs + 80);       // ax
    return (s64)v != -38;
#else
    return 0;
#endif
}

TRACEPOINT_PROBE(sched, sched_waking)
{
    u32 zero = 0;
    struct waking_ctx *c = waking_now.lookup(&zero);
    if (!c)
        return 0;
    c->wakee = args->pid;
    c->irq = waking_in_irq((u64)&zero);
    waking_next.call(args, 0);
    return 0;
}

#if OFFTOP_KERNEL_STACKS
// An interrupt's kernel stack runs through whatever it stopped: a task's
// system call, another interrupt, the idle loop. As a stack id of
// kernel_stacks each one is a new id (on a busy server ~300 a second, the
// map full every ~15 s), though only the path up to the interrupt's entry
// says anything of the wakeup (Python's waker shows that path alone). So an
// interrupt's stack is taken whole, cut after its first frame in the
// kernel's entry code (asm_sysvec_*, asm_common_interrupt: the range is
// written by Python from kallsyms), and kept in irq_paths under an id made
// of a hash of the path, with IRQ_PATH_BASE set: kernel_stacks' ids are below
// it. Entries are never deleted, so an id always names one path; a path
// whose id another holds gets -EEXIST, as a full stack map's would. Until
// the range is written, or once the map is full (paths not cut: an entry
// outside the range), kernel_stacks as before.
#define IRQ_PATH_BASE 0x40000000
BPF_PERCPU_ARRAY(irq_path_now, struct kstack_t, 1);
BPF_HASH(irq_paths, u32, struct kstack_t, 4096);

static __always_inline int irq_path_id(void *args)
{
    u32 lo_slot = CFG_ENTRY_LO, hi_slot = CFG_ENTRY_HI, zero = 0;
    u64 *lo = offtop_config.lookup(&lo_slot);
    u64 *hi = offtop_config.lookup(&hi_slot);
    if (!lo || !hi || *hi <= *lo)
        return kernel_stacks.get_stackid(args, 0);
    u64 from = *lo, to = *hi;
    struct kstack_t *p = irq_path_now.lookup(&zero);
    if (!p)
        return -12;  // ENOMEM
    long got = bpf_get_stack(args, p->ip, sizeof(p->ip), 0);
    if (got <= 0)
        return got < 0 ? (int)got : -14;  // EFAULT
    // The loops branch on nothing but their count: each is checked once by the
    // verifier, not once per place the cut could be (a branch on the stack's
    // length there made it ~70,000 instructions, ~40 ms at every start).
    // bpf_get_stack zeroes the buffer past the stack. alive: 1 up to the first
    // frame in the entry code, which is kept too; the rest is zeroed. span <
    // 2^63, so d < span is the top bit of (d - span) where d's is clear.
    u64 span = to - from, alive = 1;
    u32 h = 2166136261;  // FNV-1a over the path's words
    for (u32 i = 0; i < OFFTOP_KSTACK_DEPTH; i++) {
        u64 ip = p->ip[i] & (0 - alive);
        u64 d = ip - from;
        alive &= ~(((d - span) & ~d) >> 63) & 1;
        p->ip[i] = ip;
        h = (h ^ (u32)ip) * 16777619;
        h = (h ^ (u32)(ip >> 32)) * 16777619;
    }
    u32 id = (h & (IRQ_PATH_BASE - 1)) | IRQ_PATH_BASE;
    struct kstack_t *had = irq_paths.lookup(&id);
    if (!had) {
        if (irq_paths.insert(&id, p) == 0)
            return id;
        had = irq_paths.lookup(&id);  // another CPU's, just now (or the map is full)
        if (!had)
            return kernel_stacks.get_stackid(args, 0);  // full: as before
    }
    u64 differ = 0;
    for (u32 i = 0; i < OFFTOP_KSTACK_DEPTH; i++)
        differ |= had->ip[i] ^ p->ip[i];
    return differ ? -17 : id;  // another path has this id: EEXIST
}

// Tail-called by on_sched_waking (waking_next[1]) once it recorded an
// interrupt as the waker of a block long enough: the interrupt's path, into
// the same record (still under the wakee's pi_lock: it cannot run yet).
int on_irq_waker(void *tp_ctx)
{
    struct tracepoint__sched__sched_waking *args = tp_ctx;
    u32 slot;
    struct start_rec *rec = find_rec_at(args->pid, &slot);
    if (rec && rec->ts != 0 && rec->w.what == WAKER_IRQ << 24)
        rec->w.kstack = irq_path_id(args);
    return 0;
}
#endif

// A recorded task is being woken: remember by whom, in its record; the block
// it ends carries that into its event or aggregate. This runs in the waking
// context (current is the waker, unless in an interrupt), under the wakee's
// pi_lock, before the wakee can run: its switch-in sees a complete record.
// The first wakeup of a block wins. Stacks are taken only for blocks long
// enough to matter (CFG_WAKER_MIN): wakeups are as frequent as switches.
// Tail-called by the sched_waking probe above (waking_next).
int on_sched_waking(void *tp_ctx)
{
    struct tracepoint__sched__sched_waking *args = tp_ctx;
    u32 armed_slot = CFG_ARMED;
    u64 *armed = offtop_config.lookup(&armed_slot);
    if (!armed || !*armed)
        return 0;
    u32 slot;
    struct start_rec *rec = find_rec_at(args->pid, &slot);
    if (!rec || rec->ts == 0 || rec->w.what != WAKER_NONE)
        return 0;
    u32 zero = 0;
    struct waking_ctx *wc = waking_now.lookup(&zero);
    struct waker w = {};
    w.ustack = -1;
    w.kstack = -1;
    u32 irq = wc && wc->wakee == args->pid && wc->irq;
    if (irq) {
        w.what = WAKER_IRQ << 24;
    } else {
        u64 id = bpf_get_current_pid_tgid();
        w.tgid = id >> 32;
        w.tid = (u32)id;
        w.what = WAKER_TASK << 24;
        bpf_get_current_comm(&w.comm, sizeof(w.comm));
    }
    u32 min_slot = CFG_WAKER_MIN;
    u64 *min = offtop_config.lookup(&min_slot);
    u32 long_block = min && bpf_ktime_get_ns() - rec->ts >= *min;
    if (long_block) {
#if OFFTOP_KERNEL_STACKS
        if (!irq)
            w.kstack = kernel_stacks.get_stackid(args, 0);
#endif
#if OFFTOP_USER_STACKS && defined(__x86_64__)
        if (w.tid)
            w.ustack = walk_user_stack(args, w.tgid, NULL);
#endif
    }
    rec->w = w;
#if OFFTOP_KERNEL_STACKS
    // An interrupt's path, in a program of its own (on_irq_waker): verified apart,
    // its loops do not multiply this program's paths (the verifier took ~40 ms
    // more at every start with them inline).
    if (irq && long_block)
        waking_next.call(args, 1);
#endif
    return 0;
}

#endif

// A task is gone for good (after its last switch): drop its record, so the
// tid, when reused, is classified afresh. Runs from an RCU callback, after
// free_pid(); reuse of a pid needs the allocator to cycle through all of
// pid_max first, far longer than that grace period.
TRACEPOINT_PROBE(sched, sched_process_free)
{
    drop_rec(args->pid);
    return 0;
}

#if OFFTOP_USER_STACKS
// Whose memory each new task began with (the task that forked it: a child
// copies the forking task's memory, whatever its parent of record) and when;
// and when each process last exec'd. A process forked, blocked and reaped
// between two of Python's reads (a pre-fork server's worker, a shell's
// subshell: a millisecond) is never seen alive, and its stacks' addresses mean
// nothing without its memory map. Python resolves them in the process it was
// forked from while neither has exec'd since (offtop.bpf.lineage). Times are
// boot-clock ns, as /proc's start times. Rare events: one map update each.
struct lineage_t { u32 parent; u32 pad; u64 fork_ns; u64 exec_ns; };
BPF_TABLE("lru_hash", u32, struct lineage_t, lineage, 32768);

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 child = args->child_pid;
    struct lineage_t l = {};
    l.parent = bpf_get_current_pid_tgid() >> 32;
    l.fork_ns = bpf_ktime_get_boot_ns();
    lineage.update(&child, &l);
#if defined(__x86_64__)
    u32 *up = rules_owner.lookup(&l.parent);
    u32 owner = up ? *up : l.parent;
    rules_owner.update(&child, &owner);
#endif
    return 0;
}

static __always_inline void note_exec(u32 tgid)
{
#if defined(__x86_64__)
    rules_owner.delete(&tgid);  // another program's memory from here
#endif
    u64 now = bpf_ktime_get_boot_ns();
    struct lineage_t *l = lineage.lookup(&tgid);
    if (l) {
        l->exec_ns = now;
    } else {
        struct lineage_t fresh = {};
        fresh.exec_ns = now;
        lineage.update(&tgid, &fresh);
    }
}
#endif

// exec may turn a kernel thread into a user process (user-mode helpers) and
// makes a non-leader thread take over the leader's pid (de_thread): both
// records involved are dropped and the thread is classified afresh.
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tid = args->pid, old = args->old_pid;
    drop_rec(tid);
    if (old != tid)
        drop_rec(old);
#if OFFTOP_USER_STACKS
    note_exec(tid);     // the process (a thread that execs takes its leader's pid);
                        // its memory is the new program's from here
#endif
    return 0;
}

// Every way a task changes cgroup ends in one of these two tracepoints
// (cgroup_attach_task for cgroup.procs/threads writes and in-kernel attaches,
// cgroup_transfer_tasks for cgroup v1 cpuset moves); both fire once the move
// is complete. Rare events: one atomic add each.
static __always_inline void cgroup_moved(void)
{
    u32 slot = CFG_CGROUP_GEN;
    u64 *gen = offtop_config.lookup(&slot);
    if (gen)
        __sync_fetch_and_add(gen, 1);
}

TRACEPOINT_PROBE(cgroup, cgroup_attach_task)
{
    cgroup_moved();
    return 0;
}

TRACEPOINT_PROBE(cgroup, cgroup_transfer_tasks)
{
    cgroup_moved();
    return 0;
}

#if OFFTOP_USER_STACKS && defined(__x86_64__)
// The user registers of one thread that is not running: a task iterator
// (Python attaches it to one tid at a time and reads what it writes). A
// thread blocked since before offtop started was never seen switching out,
// so the probe has no record of its rbp, and /proc gives only its sp and
// pc; frame-pointer code computes its frame from rbp, and without it the
// unwind of such a thread stops after the first frame. The registers are
// where any task's are, at the top of its kernel stack, saved at kernel
// entry (bp at 32, ip at 128, cs at 136, sp at 152, as above).
// Not loaded with the rest: only when such a block is met (offtop.bpf.task_regs).
struct seq_file;
struct bpf_iter_meta {
    struct seq_file *seq;
    u64 session_id;
    u64 seq_num;
};
struct bpf_iter__task {
    struct bpf_iter_meta *meta;
    struct task_struct *task;
};

BPF_ITER(task)
{
    struct task_struct *task = ctx->task;
    if (!task)
        return 0;
    char *regs = (char *)bpf_task_pt_regs(task);
    u64 v[4] = {};              // ip, cs, flags, sp
    u64 out[3] = {};            // ip, sp, bp
    bpf_probe_read_kernel(v, sizeof(v), regs + 128);
    if ((v[1] & 3) != 3)
        return 0;               // not user mode (a kernel thread)
    out[0] = v[0];
    out[1] = v[3];
    bpf_probe_read_kernel(&out[2], sizeof(out[2]), regs + 32);
    bpf_seq_write(ctx->meta->seq, out, sizeof(out));
    return 0;
}
#endif
