"""What stops a local Ray when the process that started it is killed (SIGKILL, the OOM killer): a small watcher
process, started beside Ray, that waits for its starter to die.

Ray's own processes follow their parent only in part: gcs_server and the raylet end with the driver, but the
raylet's DashboardAgent and RuntimeEnvAgent, reparented to init, stay about a minute (they try to report the
raylet's death to a GCS that is gone), and the session directory stays for good. The watcher holds the read end of
a pipe whose write end only the starter holds: end of file means the starter is gone. If `stop_ray` ran first it
has nothing left to do; otherwise it ends every process that still has a file open in the session directory, or
names it on its command line, and removes the directory.

    DLLM_RL_RAY_SESSION=<session dir> python -m dllm_rl.workers.reaper     (stdin: the pipe)

(the directory travels in the environment, so that the watcher is not itself a process "mentioning" it)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time


def start_reaper(session_dir: str) -> int:
    """Start the watcher of `session_dir` for this process; returns the pipe's write end (close it after a clean
    shutdown: the watcher then exits, finding nothing)."""
    read, write = os.pipe()  # not inherited by other children (PEP 446): only this process holds `write`
    subprocess.Popen([sys.executable, "-m", "dllm_rl.workers.reaper"], stdin=read, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True,
                     env={**os.environ, "DLLM_RL_RAY_SESSION": session_dir})
    os.close(read)
    return write


def uses(process, session_dir: str) -> bool:
    """Whether `process` (psutil) belongs to the Ray session in `session_dir`."""
    try:
        if any(session_dir in part for part in process.cmdline()):
            return True
        return any(f.path.startswith(session_dir) for f in process.open_files())
    except Exception:  # gone meanwhile, or not ours to read
        return False


def reap(session_dir: str, rounds: int = 5) -> None:
    """End the processes of the session in `session_dir` (SIGKILL), then remove the directory."""
    import psutil

    me = os.getpid()
    for _ in range(rounds):
        left = [p for p in psutil.process_iter() if p.pid != me and uses(p, session_dir)]
        if not left:
            break
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass
        time.sleep(0.2)
    shutil.rmtree(session_dir, ignore_errors=True)


def main(session_dir: str) -> None:
    while sys.stdin.buffer.read(1):  # nothing is ever written: this returns at end of file, when the starter is gone
        pass
    if os.path.isdir(session_dir):  # a clean stop removes it first
        reap(session_dir)


if __name__ == "__main__":
    main(os.environ["DLLM_RL_RAY_SESSION"])
