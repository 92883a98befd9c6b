"""The App's keys: bindings, what the command palette offers, threshold presets.

Kept apart from `offtop.app` so the App reads as wiring; the help screen
and the key bar are built from these same bindings.
"""

from __future__ import annotations

from textual.binding import Binding, BindingType

#: The quit keys: one line in the help, though q is passed on where it is text.
_QUIT = Binding.Group("Quit")

#: The App's own keys (each pane binds its own; the help screen lists both).
APP_BINDINGS: list[BindingType] = [
    # q is a priority key, as ^c is: taken before the focused pane sees it, so that
    # a busy event loop does not hand it from pane to pane first (under the busy
    # server's full load, q reached the quit action 0.06-0.74 s after it was typed;
    # as a priority key 0.02-0.35 s). Where q is text, or closes a screen of its
    # own, it is passed on (`OfftopApp.action_quit_key`).
    Binding("q", "quit_key", "Quit", tooltip="Quit (the terminal is restored)", id="app.quit",
            priority=True, group=_QUIT),
    Binding("f10", "quit", "Quit", show=False, key_display="F10", id="app.quit_f10",
            group=_QUIT),
    Binding("ctrl+c", "quit", "Quit", show=False, priority=True, id="app.quit_ctrl_c",
            group=_QUIT),
    Binding("f1", "help", "Help", key_display="F1", tooltip="This help", id="app.help"),
    Binding("question_mark", "help", "Help", show=False, key_display="?", id="app.help_q"),
    Binding("p", "toggle_pause", "Pause", id="app.pause",
            tooltip="Pause / resume the display (data keeps accumulating)"),
    Binding("space", "toggle_pause", "Pause", show=False, id="app.pause_space"),
    Binding("slash", "filter", "Filter", key_display="/", id="app.filter",
            tooltip="Filter by name, pid or frame text (the flame graph highlights it)"),
    Binding("f3", "filter", "Filter", show=False, key_display="F3", id="app.filter_f3"),
    Binding("s", "cycle_sort", "Sort", tooltip="Sort by the next column", id="app.sort"),
    Binding("f6", "sort_menu", "Sort by…", show=False, key_display="F6",
            tooltip="Choose the sort column", id="app.sort_menu"),
    Binding("t", "toggle('processes')", "Threads/procs", id="app.processes",
            tooltip="Rank threads or processes"),
    Binding("F", "toggle('follow')", "Follow", show=False, id="app.follow",
            tooltip="The cursor follows its task across re-sorts (else keeps its row)"),
    Binding("a", "stacks('all_tasks')", "All stacks", id="app.all_stacks",
            tooltip="Stacks pane: the selected task's stacks, or all tasks' stacks"),
    Binding("f", "flame", "Flame", tooltip="Flame graph of the stacks pane's scope",
            id="app.flame"),
    Binding("i", "toggle('hide_idle')", "Idle", show=False, id="app.idle",
            tooltip="Hide idle waits (poll, epoll_wait, select, wait4, idle pool workers)"),
    Binding("m", "merge", "Merge", show=False, id="app.merge",
            tooltip="Merge identical stacks: off, across threads, across one command"),
    Binding("c", "stacks('cumulative')", "Since start", show=False, id="app.cumulative",
            tooltip="Stacks pane: since offtop started, or the last interval"),
    Binding("w", "export", "Write", show=False, id="app.export",
            tooltip="Write the stacks pane's view to a file (folded, pprof, speedscope)"),
    Binding("plus", "threshold(1)", "Threshold", key_display="+", priority=True,
            tooltip="Raise the long-block threshold one step", id="app.threshold_up"),
    Binding("equals_sign", "threshold(1)", "Threshold up", show=False, key_display="=",
            priority=True, id="app.threshold_up_eq"),
    Binding("minus", "threshold(-1)", "Threshold down", show=False, key_display="-",
            priority=True, tooltip="Lower the long-block threshold one step",
            id="app.threshold_down"),
    Binding("K", "toggle('show_kernel')", "Kernel frames", show=False,
            tooltip="Show / hide kernel frames", id="app.kernel"),
    Binding("U", "toggle('show_user')", "User frames", show=False,
            tooltip="Show / hide user frames", id="app.user"),
    Binding("escape", "go_back", "Back", show=False, id="app.back",
            tooltip="Close the filter, leave the tree or flame graph, back to the tasks"),
    Binding("tab", "focus_next", "Next pane", show=False, id="app.next_pane"),
    Binding("shift+tab", "focus_previous", "Previous pane", show=False,
            id="app.previous_pane"),
    Binding("ctrl+p", "command_palette", "Commands", show=False,
            tooltip="Command palette (sort by, threshold presets, ...)", id="app.palette"),
]


#: The actions the command palette offers (by binding id), besides sorts and presets.
PALETTE = ("app.pause", "app.processes", "app.follow", "app.all_stacks", "app.flame",
           "app.idle", "app.merge", "app.cumulative", "app.export", "app.kernel", "app.user",
           "app.sort_menu")

#: Threshold presets offered by the command palette.
THRESHOLD_PRESETS_NS: tuple[int, ...] = (
    0, 100_000, 1_000_000, 10_000_000, 100_000_000, 500_000_000, 1_000_000_000,
    10_000_000_000, 60_000_000_000,
)

#: The keys of a replay that can travel in time (`--replay`), mpv's: `,` `.` step one
#: interval, `<` `>` ten, `[` `]` halve and double the speed; g / G go to the start
#: and the end (not Home/End: the focused tables and the slider use those). Steps
#: pause, as a video player's frame steps do; p and space pause the replay itself
#: (the display's pause is disabled then: a replay's display follows its position).
#: The app enables them only in such a replay (`check_action`), so the key bar and
#: the help show them only there.
REPLAY_BINDINGS: list[BindingType] = [
    Binding("p", "replay('pause')", "Play/pause", id="replay.pause",
            tooltip="Pause / play the replay"),
    Binding("space", "replay('pause')", "Play/pause", show=False, id="replay.pause_space"),
    Binding("comma", "replay('step', -1)", "Back", key_display=",", id="replay.back",
            tooltip="One interval back (and pause)"),
    Binding("full_stop", "replay('step', 1)", "Forward", key_display=".", id="replay.forward",
            tooltip="One interval forward (and pause)"),
    Binding("less_than_sign", "replay('step', -10)", "Back 10", show=False, key_display="<",
            tooltip="Ten intervals back (and pause)", id="replay.back10"),
    Binding("greater_than_sign", "replay('step', 10)", "Forward 10", show=False,
            key_display=">", tooltip="Ten intervals forward (and pause)",
            id="replay.forward10"),
    Binding("g", "replay('start')", "Start", show=False, id="replay.start",
            tooltip="The first interval of the recording"),
    Binding("G", "replay('end')", "End", show=False, id="replay.end",
            tooltip="The last interval of the recording"),
    Binding("left_square_bracket", "replay('slower')", "Slower", show=False, key_display="[",
            tooltip="Play at half the speed (down to 1/16x)", id="replay.slower"),
    Binding("right_square_bracket", "replay('faster')", "Faster", show=False,
            key_display="]", tooltip="Play at twice the speed (up to 64x)",
            id="replay.faster"),
]
