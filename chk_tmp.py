import sys, torch
from engine import LLM, SamplingParams
from tests.test_reference import prompt_logits
path = "/var/tmp/layerstream-bench/smollm2/SmolLM2-135M-Instruct.Q4_0.gguf"
ex = LLM(path, max_model_len=128, max_num_seqs=1, dtype="float32")
ids = ex.tokenizer.encode("The capital of Italy is")
ref = torch.log_softmax(prompt_logits(ex, ids).float(), -1); ex.close()
llm = LLM(path, max_model_len=128, max_num_seqs=1)
budget = llm.plan.budget_keeping(15)
r = torch.log_softmax(prompt_logits(llm, ids).float(), -1); llm.close()
llm = LLM(path, max_model_len=128, max_num_seqs=1, max_device_memory=budget)
c = torch.log_softmax(prompt_logits(llm, ids).float(), -1)
p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
print(llm.generate([ids], p)[0].outputs[0].text)
llm.close()
top = ref.topk(5, -1).indices
print("resident fast vs exact", (ref.gather(-1, top) - r.gather(-1, top)).abs().max().item())
print("capped fast vs exact", (ref.gather(-1, top) - c.gather(-1, top)).abs().max().item())
