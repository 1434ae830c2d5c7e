"""vLLM as a benchmark peer, run by bench.offline (through bench/peers.py) as a file inside
vLLM's own venv (.venv-vllm, made by bench/setup_vllm.sh); it imports nothing from kvserve.

It talks JSON lines over stdin/stdout, so the vLLM engine is built once and stays loaded
while the other systems take their turns on the same workloads:

    {"cmd": "init", "model": "...", "engine": {...vllm.LLM kwargs...}}  -> {"version": "..."}
    {"cmd": "run", "prompts": [[ids]], "lengths": [n, ...]}            -> {"seconds": t}
    {"cmd": "exit"}

A run is timed like every other system's: from submitting the first request to the
last token, with EOS ignored and each request's own max_tokens. vLLM's logs go to stderr.
"""

import json
import os
import sys
import time


def main() -> None:
    llm = None
    # Keep vLLM's prints off the protocol channel, its engine-core child process's too:
    # replies go to a copy of the original stdout, and fd 1 becomes stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        message = json.loads(line)
        if message["cmd"] == "init":
            import vllm

            llm = vllm.LLM(message["model"], **message["engine"])
            answer = {"version": vllm.__version__}
        elif message["cmd"] == "run":
            answer = {"seconds": run(llm, message["prompts"], message["lengths"])}
        else:
            break
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


def run(llm, prompts: list[list[int]], lengths: list[int]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if produced != lengths:
        raise RuntimeError("vLLM generated other lengths than asked")
    return elapsed


if __name__ == "__main__":
    main()
