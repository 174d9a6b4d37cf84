#!/usr/bin/env python3
"""llama.cpp's decode rate on the default GGUF, measured as `populora bench
generate` measures its batch-1 row: one chat prompt, greedy, N new tokens,
prefill included, best of R repeats.

Needs llama-cpp-python (`pip install llama-cpp-python`, built from source by
pip in about 8 minutes). Prints one JSON object.

    python3 scripts/llama-cpp-bench.py [--threads 2] [--tokens 64] [--repeats 3] [GGUF]
"""
import argparse
import json
import os
import platform
import time

import llama_cpp
import numpy as np

DEFAULT = os.path.expanduser("~/.cache/populora/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="?", default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
    )
    # The same text as `bench generate`'s first prompt, in SmolLM2's chat format.
    text = (
        "<|im_start|>user\nWrite a Python function number 0 that adds 0 to each "
        "element of a list.<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
    rates = []
    for _ in range(args.repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        generated = []
        while True:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(token)
            if len(generated) == args.tokens:
                break  # as ours: a finished row runs no further pass
            llm.eval([token])
        rates.append(len(generated) / (time.perf_counter() - start))
    print(json.dumps({
        "llama_cpp_python": llama_cpp.__version__,
        "threads": args.threads,
        "gguf": os.path.basename(args.gguf),
        "prompt_tokens": len(prompt),
        "new_tokens": args.tokens,
        "batch1_tok_s": max(rates),
        "every_repeat_tok_s": rates,
        "machine": platform.processor() or platform.machine(),
    }))


if __name__ == "__main__":
    main()
