// offtop: off-CPU time from sched:sched_switch.
//
// At switch-out of a task in a recorded state, remember when and where it
// stopped (timestamp, state, stack ids, cgroup). At switch-in of a task with
// such a record, the interval is `now - timestamp`, routed to exactly one of:
//   - >= offcpu_thresh_ns: one perf-buffer event built in a per-CPU payload;
//   - otherwise: summed into an in-kernel hash (total, count, max).
// Never both, so totals never double count (perf's --off-cpu-thresh design).
//
// This program reads only the tracepoint's own fields and BPF helpers, never
// a kernel struct, so any kernel header tree compiles it for any kernel.
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
//   OFFTOP_STACK_ENTRIES, OFFTOP_START_ENTRIES, OFFTOP_AGG_ENTRIES: map sizes
//   OFFTOP_KSTACK_DEPTH, OFFTOP_USTACK_DEPTH: frames kept per stack

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
#define C_MAX 12

#define CFG_GEN 0

// Mirrored by decode.StartRecord.
struct start_rec {
    u64 ts;
    u64 cgroup_id;
    u32 tgid;
    u32 state;
    s32 ustack;
    s32 kstack;
};

// Mirrored by decode.AggKey.
struct agg_key {
    u32 tgid;
    u32 tid;
    s32 ustack;
    s32 kstack;
    u32 state;
    u32 pad;
};

// Mirrored by decode.AggValue.
struct agg_val {
    u64 total_ns;
    u64 max_ns;
    u64 count;
    char comm[16];
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
};

struct kstack_t { u64 ip[OFFTOP_KSTACK_DEPTH]; };
struct ustack_t { u64 ip[OFFTOP_USTACK_DEPTH]; };

// The threshold, written from Python at any time (bcc 0.26 cannot load
// true BPF globals, so it is a one-slot array map of the global's name).
BPF_ARRAY(offcpu_thresh_ns, u64, 1);
BPF_ARRAY(offtop_config, u64, 4);
BPF_PERCPU_ARRAY(offtop_counters, u64, C_MAX);
BPF_PERCPU_ARRAY(offcpu_payload, struct offcpu_event, 1);
BPF_PERF_OUTPUT(offcpu_events);

BPF_TABLE("stacktrace", int, struct kstack_t, kernel_stacks, OFFTOP_STACK_ENTRIES);
BPF_TABLE("stacktrace", int, struct ustack_t, user_stacks, OFFTOP_STACK_ENTRIES);

// Tasks off the CPU right now. LRU: a task that exits while asleep is never
// switched in again; Python also reaps such entries.
BPF_TABLE("lru_hash", u32, struct start_rec, offcpu_start, OFFTOP_START_ENTRIES);

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

static __always_inline void on_switch_out(void *args, long prev_state, u64 now)
{
    u32 state = normalize_state(prev_state);
    if (!(state & OFFTOP_STATE_MASK))
        return;

    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    if (tid == 0)
        return;
#if OFFTOP_SELF_TGID
    if (tgid == OFFTOP_SELF_TGID)
        return;
#endif

#if OFFTOP_FILTER_PID || OFFTOP_FILTER_TID
    if (!pid_filter.lookup(&tgid) && !tid_filter.lookup(&tid))
        return;
#endif
#if OFFTOP_FILTER_CGROUP
    if (cgroup_filter.check_current_task(0) != 1)
        return;
#endif

    struct start_rec rec = {};
    rec.ts = now;
    rec.tgid = tgid;
    rec.state = state;
    rec.ustack = -1;
    rec.kstack = -1;

#if OFFTOP_USER_STACKS
    // The user walk goes first: it fails with EFAULT exactly when the task has
    // no user context (kernel threads), which lets us drop those before
    // paying for a kernel walk.
    rec.ustack = user_stacks.get_stackid(args, BPF_F_USER_STACK);
    if (rec.ustack < 0) {
#if !OFFTOP_KTHREADS
        if (rec.ustack == -14)
            return;
#endif
        count_stack_error(rec.ustack, C_USTACK_EFAULT);
    }
#elif !OFFTOP_KTHREADS
    {
        // No user stacks wanted: read one user frame, which is cheap and
        // tells kernel threads (nothing to read) from user tasks.
        u64 ip = 0;
        if (bpf_get_stack(args, &ip, sizeof(ip), BPF_F_USER_STACK) <= 0)
            return;
    }
#endif

#if OFFTOP_KERNEL_STACKS
    rec.kstack = kernel_stacks.get_stackid(args, 0);
    if (rec.kstack < 0)
        count_stack_error(rec.kstack, C_KSTACK_EFAULT);
#endif

    rec.cgroup_id = bpf_get_current_cgroup_id();
    if (offcpu_start.update(&tid, &rec) != 0)
        count(C_START_FULL);
}

static __always_inline void on_switch_in(void *args, u32 tid, const char *next_comm, u64 now)
{
    if (tid == 0)
        return;
    struct start_rec *rec = offcpu_start.lookup(&tid);
    if (!rec)
        return;
    struct start_rec s = *rec;
    offcpu_start.delete(&tid);
    if (now < s.ts)
        return;
    u64 delta = now - s.ts;

    u32 zero = 0;
    u64 *thresh = offcpu_thresh_ns.lookup(&zero);
    if (thresh && delta >= *thresh) {
        struct offcpu_event *ev = offcpu_payload.lookup(&zero);
        if (!ev)
            return;
        ev->end_ns = now;
        ev->delta_ns = delta;
        ev->cgroup_id = s.cgroup_id;
        ev->tgid = s.tgid;
        ev->tid = tid;
        ev->ustack = s.ustack;
        ev->kstack = s.kstack;
        ev->state = s.state;
        ev->cpu = bpf_get_smp_processor_id();
        bpf_probe_read_kernel(&ev->comm, sizeof(ev->comm), next_comm);
        if (offcpu_events.perf_submit(args, ev, sizeof(*ev)) != 0)
            count(C_OUTPUT_FAIL);
        return;
    }

    struct agg_key key = {};
    key.tgid = s.tgid;
    key.tid = tid;
    key.ustack = s.ustack;
    key.kstack = s.kstack;
    key.state = s.state;

    u32 gen_slot = CFG_GEN;
    u64 *gen = offtop_config.lookup(&gen_slot);
    struct agg_val *val;
    // A task runs on one CPU at a time and its tid is in the key, so plain
    // (non-atomic) updates of one entry never race with each other.
    if (gen && *gen) {
        val = offcpu_agg1.lookup(&key);
        if (!val) {
            struct agg_val init = {};
            bpf_probe_read_kernel(&init.comm, sizeof(init.comm), next_comm);
            offcpu_agg1.insert(&key, &init);
            val = offcpu_agg1.lookup(&key);
        }
    } else {
        val = offcpu_agg0.lookup(&key);
        if (!val) {
            struct agg_val init = {};
            bpf_probe_read_kernel(&init.comm, sizeof(init.comm), next_comm);
            offcpu_agg0.insert(&key, &init);
            val = offcpu_agg0.lookup(&key);
        }
    }
    if (!val) {
        count(C_AGG_FULL);
        return;
    }
    val->total_ns += delta;
    val->count += 1;
    if (delta > val->max_ns)
        val->max_ns = delta;
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    on_switch_in(args, args->next_pid, args->next_comm, now);
    on_switch_out(args, args->prev_state, now);
    return 0;
}
