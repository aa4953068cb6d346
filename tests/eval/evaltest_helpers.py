"""Shared pieces of the evaluation tests: paths of the bundled real samples, the lm-eval
reference (``HFLM`` on a transformers model, no hub), random models converted to msllm.

(A uniquely named module rather than ``conftest`` so that ``import`` never picks up another test
folder's conftest.)
"""

from __future__ import annotations

import os

from helpers import DATA, REPO, TOKENIZER  # noqa: F401  (re-exported to the evaluation tests)

EVAL_DATA = os.path.join(DATA, "eval")

# the random LLaMA the parity tests use: real 32000 vocabulary (the real tokenizer's ids), GQA,
# odd MLP width; small enough that lm-eval's full-logits forward stays cheap
HF_CONFIG = dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
MAX_LENGTH = 1024


def sp_hf_tokenizer(path: str = TOKENIZER):
    """A transformers tokenizer over the same SentencePiece model, tokenising exactly as
    ``sentencepiece`` does (and so as LLaMA's original slow ``LlamaTokenizer``): transformers 5's
    ``LlamaTokenizer`` is a ``tokenizers`` conversion that splits runs of spaces differently
    (``"a  b"``), so it is not the tokenizer LLaMA models were trained with. BOS is added by
    ``build_inputs_with_special_tokens`` when ``add_special_tokens`` (HFLM's ``add_bos_token``)."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    class LlamaSentencePieceTokenizer(SentencePieceBackend):
        vocab_files_names = {"vocab_file": "tokenizer.model"}
        model_input_names = ["input_ids", "attention_mask"]

        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
            return [self.bos_token_id] + token_ids_0 + (token_ids_1 or [])

        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            # runs of ordinary ids through sentencepiece (byte fallback joined), special ids as
            # their text ("<s>") unless skipped, as the slow LlamaTokenizer decodes
            ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
            out, run = [], []
            for i in ids:
                if i in self.all_special_ids:
                    out.append(self.sp_model.decode(run))
                    run = []
                    if not skip_special_tokens:
                        out.append(self.convert_ids_to_tokens(i))
                else:
                    run.append(i)
            return "".join(out + [self.sp_model.decode(run)])

    return LlamaSentencePieceTokenizer(vocab_file=path, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       legacy=True)


def hflm(model, batch_size: int = 4):
    """lm-eval's ``HFLM`` on a transformers model object with BOS (``add_bos_token=True``)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=sp_hf_tokenizer(), add_bos_token=True, max_length=MAX_LENGTH,
                batch_size=batch_size, device="cpu")


def instances(pairs, request_type: str = "loglikelihood"):
    """lm-eval ``Instance`` s for ``(context, continuation)`` pairs (or ``(context, gen_kwargs)``)."""
    from lm_eval.api.instance import Instance

    return [Instance(request_type=request_type, doc={}, arguments=tuple(p), idx=i) for i, p in enumerate(pairs)]
