"""Peak memory of the benchmark process itself."""


def peak_rss() -> int:
    """This process's peak resident set in bytes: VmHWM of /proc/self/status (Linux).

    Not ru_maxrss: Linux carries the peak of the image a process was exec'd from into it,
    and `subprocess` starts children with vfork, so a child of a large parent reported at
    least the parent's RSS (a 1,077 MiB training child read as 1,223 MiB after the parent
    had run the planner's probe).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")
