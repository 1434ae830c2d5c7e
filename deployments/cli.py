"""The `kvserve` command line."""

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text offline and stream it to the terminal")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="local HF directory or .gguf file (default: bundled SmolLM2)"
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default: on)",
    )
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])

    args = parser.parse_args(argv)
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from replica import LLM, SamplingParams
    from replica.model_loader import ModelNotFoundError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype)
    except (ValueError, ModelNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    engine = llm.engine
    prompt = args.prompt
    if args.chat and llm.tokenizer.chat_template is not None:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    try:
        engine.add_request(prompt, params)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
