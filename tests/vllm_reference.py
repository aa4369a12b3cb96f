"""vLLM's offline ``LLM.generate``, the reference the vLLM engine's tests compare with, run as
its own process (``python -m tests.vllm_reference < request.json``): vLLM's engine core
starts child processes, which a multiprocessing pool's worker process may not have.

Reads ``{"path": model directory, "prompts": [[token ids]], "params": [SamplingParams
keywords]}`` on stdin; prints ``[[text, finish_reason, completion tokens], ...]`` on a line of
stdout of its own after :data:`MARK` (vLLM logs to stdout too).
"""

from __future__ import annotations

import json
import sys

MARK = "vllm-reference: "


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.load(sys.stdin)
    llm = LLM(model=request["path"], dtype="float32", max_model_len=256, enforce_eager=True,
              seed=0, kv_cache_memory_bytes=64 << 20)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]],
                           [SamplingParams(**p) for p in request["params"]], use_tqdm=False)
    print(MARK + json.dumps([[o.outputs[0].text, o.outputs[0].finish_reason,
                       len(o.outputs[0].token_ids)] for o in outputs]))


if __name__ == "__main__":
    main()
