"""Subprocess side of the reliability tests (run as ``python _worker.py MODE ...``).

Modes:
  train CKPT SPILL_DIR STEPS PAD_BYTES  train TinyGPT + HybridAdam(nvme), resuming from CKPT if it
                                        exists, saving a checkpoint after every step and printing
                                        ``saved N``; ``done`` at the end.
  killpoints DIR                        for each point of a save, fork a child that saves and is
                                        SIGKILLed at that point; print one JSON line of results.
  serve                                 fork server running the commands above (see serve()).
  store_exit SPILL_BASE HOW             make a TierStore with a spilled key, print its spill dir,
                                        then exit without close (HOW=exit) or SIGKILL itself
                                        (HOW=kill).
  fork_child SPILL_BASE                 for each backend and each way a forked child can end with
                                        its parent's live TierStore (exit, close, drop, use it),
                                        fork one and check the parent's spill dir and data after;
                                        print one JSON line per child and one of results.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch


def build(spill_dir):
    from models import TinyGPT  # noqa: PLC0415

    from tiermem.optim import HybridAdam  # noqa: PLC0415

    torch.manual_seed(0)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=0.5,
                     state_tier="nvme", nvme_dir=spill_dir, chunk_numel=1024)
    return model, opt


def train_step(model, opt, step):
    from models import make_batch  # noqa: PLC0415

    idx, tgt = make_batch(step)
    _, loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def train(ckpt, spill_dir, steps, pad_bytes):
    from tiermem.checkpoint import load_checkpoint, save_checkpoint  # noqa: PLC0415

    torch.set_num_threads(1)
    model, opt = build(spill_dir)
    step, losses = 0, []
    if os.path.exists(ckpt):
        extra = load_checkpoint(ckpt, model=model, optimizer=opt)["extra"]
        step, losses = extra["step"], list(extra["losses"])
        print(f"resumed {step}", flush=True)
    pad = torch.zeros(pad_bytes // 4)  # makes each save long enough to be killed inside it
    while step < steps:
        losses.append(train_step(model, opt, step))
        step += 1
        pad[0] = step
        save_checkpoint(ckpt, model=model, optimizer=opt,
                        extra={"step": step, "losses": losses, "pad": pad})
        print(f"saved {step}", flush=True)
    opt.close()
    print("done", flush=True)


def killpoints(directory):
    import tiermem.checkpoint as ck  # noqa: PLC0415

    torch.set_num_threads(1)  # no OpenMP worker threads: GNU OpenMP is not fork-safe
    path = os.path.join(directory, "ckpt.pt")
    ck.save_checkpoint(path, extra={"step": 0, "w": torch.full((1 << 18,), 0.0)})

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    def arm(point):
        if point == "after_create":
            torch.save = die
        elif point == "mid_write":
            real, calls = ck._HashingWriter.write, [0]

            def write(self, data):
                calls[0] += 1
                if calls[0] == 3:
                    real(self, bytes(memoryview(data).cast("B")[: max(1, len(data) // 2)]))
                    self._f.flush()
                    die()
                return real(self, data)
            ck._HashingWriter.write = write
        elif point == "before_fsync":
            os.fsync = die
        elif point == "before_rename":
            os.replace = die
        elif point == "after_rename":
            ck._fsync_dir = die

    results = {}
    for i, point in enumerate(["after_create", "mid_write", "before_fsync", "before_rename",
                               "after_rename"]):
        before = ck.load_checkpoint(path)["extra"]["step"]
        pid = os.fork()
        if pid == 0:
            arm(point)
            ck.save_checkpoint(path, extra={"step": before + 1,
                                            "w": torch.full((1 << 18,), float(before + 1))})
            os._exit(0)  # not reached: the save kills the child
        _, status = os.waitpid(pid, 0)
        temps = sorted(n for n in os.listdir(directory) if ".tiermem-tmp-" in n)
        try:
            payload = ck.load_checkpoint(path)
            step = payload["extra"]["step"]
            consistent = bool((payload["extra"]["w"] == float(step)).all())
            error = None
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            step, consistent, error = None, False, f"{type(exc).__name__}: {exc}"
        removed = ck.cleanup_temp_files(directory)
        results[point] = dict(signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                              before=before, loaded=step, consistent=consistent, error=error,
                              temps=len(temps), removed=len(removed))
    print(json.dumps(results), flush=True)


def store_exit(base, how):
    from tiermem import StoreConfig, TierStore  # noqa: PLC0415

    store = TierStore(StoreConfig(cpu_bytes=1 << 20, nvme_bytes=1 << 20, nvme_dir=base,
                                  io_backend="posix", io_threads=1))
    store.put("k", torch.ones(1000), tier="nvme")
    store.synchronize()
    print(store._spill.dir_path, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)  # no close(): the atexit finalizer must remove the directory


def _fork_child_ends(holder, how):
    """In a forked child: end the way ``how`` says, through sys.exit (atexit hooks run)."""
    from tiermem.store.store import StoreClosedError  # noqa: PLC0415

    line = {"how": how, "error": None}
    if how == "close":
        holder[0].close()
    elif how == "drop":
        holder.clear()
        import gc  # noqa: PLC0415

        gc.collect()
    elif how == "use":
        try:
            holder[0].get(0, "cpu")
        except StoreClosedError as exc:
            line["error"] = str(exc)
    print(json.dumps(line), flush=True)
    sys.exit(0)


def fork_child(base):
    from tiermem import StoreConfig, TierStore  # noqa: PLC0415

    torch.set_num_threads(1)  # no OpenMP worker threads: GNU OpenMP is not fork-safe
    results = {}
    for backend in ("posix", "aiofiles"):
        for how in ("exit", "close", "drop", "use"):
            holder = [TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=1 << 20, nvme_bytes=1 << 20,
                                            nvme_dir=base, io_backend=backend, io_threads=1,
                                            o_direct=False))]
            xs = {i: torch.full((1000,), float(i)) for i in range(3)}
            for i, x in xs.items():
                holder[0].put(i, x, tier="nvme")
            holder[0].synchronize()
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _fork_child_ends(holder, how)
            _, status = os.waitpid(pid, 0)
            store = holder[0]
            result = dict(code=os.waitstatus_to_exitcode(status),
                          dir_kept=os.path.isdir(store._spill.dir_path))
            try:
                result["data_ok"] = all(torch.equal(store.get(i, "cpu"), x) for i, x in xs.items())
            except Exception as exc:  # noqa: BLE001  (reported to the test)
                result["data_ok"] = f"{type(exc).__name__}: {exc}"
            store.close()
            result["removed_on_close"] = not os.path.exists(store._spill.dir_path)
            results[f"{backend}-{how}"] = result
    results["optimizer"] = _fork_optimizer(os.path.join(base, "opt"))
    print(json.dumps({"results": results}), flush=True)


def _fork_optimizer(spill_dir):
    """A HybridAdam on NVMe, forked after a step: the child's step is refused, its exit leaves
    the parent's spill dir, and the parent steps on."""
    os.mkdir(spill_dir)
    model, opt = build(spill_dir)
    train_step(model, opt, 0)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        line = {"how": "optimizer", "error": None}
        try:
            train_step(model, opt, 1)
        except RuntimeError as exc:
            line["error"] = str(exc)
        print(json.dumps(line), flush=True)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    result = dict(code=os.waitstatus_to_exitcode(status), dir_kept=len(os.listdir(spill_dir)) == 1)
    try:
        train_step(model, opt, 1)  # the parent's optimizer still steps
        result["data_ok"] = True
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        result["data_ok"] = f"{type(exc).__name__}: {exc}"
    opt.close()
    result["removed_on_close"] = os.listdir(spill_dir) == []
    return result


def serve():
    """Fork server: import everything once, then run each command in a forked child.

    Reads JSON commands from stdin, one per line: ``{"cmd": "train", "args": [...]}`` forks a
    trainer (it prints ``child PID`` first, so the test can SIGKILL it) and prints ``exit
    STATUS`` when it ends (``-9`` for SIGKILL); ``{"cmd": "killpoints", "args": [DIR]}``;
    ``{"cmd": "quit"}``. Forking a warm process saves the ~5 s that importing torch._dynamo
    (pulled in by torch.optim.Optimizer) costs each fresh interpreter on this machine.
    """
    import threading  # noqa: PLC0415

    import torch._dynamo  # noqa: F401, PLC0415  (the slow import, done once)

    import models  # noqa: F401, PLC0415
    import tiermem.checkpoint  # noqa: F401, PLC0415
    import tiermem.optim  # noqa: F401, PLC0415

    torch.set_num_threads(1)  # no OpenMP worker threads: GNU OpenMP is not fork-safe
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "killpoints":
            killpoints(*cmd["args"])
            continue
        if threading.active_count() != 1:  # forking with Python threads running is unsafe
            print(f"error: server has {threading.active_count()} threads", flush=True)
            continue
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                print(f"child {os.getpid()}", flush=True)
                train(*cmd["args"][:2], *map(int, cmd["args"][2:]))
            except BaseException as exc:  # noqa: BLE001  (reported through the exit status)
                print(f"error: {type(exc).__name__}: {exc}", flush=True)
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"exit {-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)}",
              flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "train":
        train(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "killpoints":
        killpoints(args[0])
    elif mode == "serve":
        serve()
    elif mode == "store_exit":
        store_exit(args[0], args[1])
    elif mode == "fork_child":
        fork_child(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
