"""cpusample.py SECONDS: CPU % of each epdserve process (by role) over SECONDS, sampled every 0.5 s, plus pids."""
import os, sys, time
ROLES = ("encoder", "prefill", "decode", "gateway", "bench", "tp-follower", "launch")
def procs():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        cmd = [c.decode(errors="replace") for c in cmd]
        if "epdserve.cli" not in cmd:
            continue
        role = next((c for c in cmd[cmd.index("epdserve.cli") + 1:] if c in ROLES), "?")
        out[int(pid)] = role
    return out
def ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
hz = os.sysconf("SC_CLK_TCK")
dur = float(sys.argv[1]); ps = procs(); print("pids", {r: p for p, r in ps.items()})
last = {p: ticks(p) for p in ps}; t0 = time.monotonic(); rows = []
while time.monotonic() - t0 < dur:
    time.sleep(0.5)
    now = {}
    for p in ps:
        try: now[p] = ticks(p)
        except OSError: pass
    rows.append({ps[p]: (now[p] - last[p]) / hz / 0.5 * 100 for p in now})
    last = now
for r in rows:
    print("  ".join(f"{k}={v:4.0f}%" for k, v in sorted(r.items())))
roles = sorted({k for r in rows for k in r})
print("mean", "  ".join(f"{k}={sum(r.get(k, 0) for r in rows) / len(rows):4.0f}%" for k in roles))
