"""The request of SGLang's native ``/generate``: text or token ids in, no chat template (its answers:
:mod:`epdserve.frontend.native.generate`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from epdserve.frontend.request import Int64, LogitBias, MaxTokens, Seed, TokenId, stop_list
from epdserve.frontend.structured import StructuredOutputs


class GenerateSamplingParams(BaseModel):
    """``sampling_params`` of SGLang's ``/generate`` (``sglang/srt/sampling/sampling_params.py``): the same
    defaults (``max_new_tokens`` 128, ``temperature`` 1, ``top_k`` -1). Unknown fields are ignored; the ones that
    would change the answer and are not implemented are refused by :meth:`GenerateRequest.unsupported`."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: MaxTokens = 128
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int64 = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: Seed | None = None
    n: int = Field(default=1, ge=1)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = 1.0
    logit_bias: LogitBias = None
    json_schema: str | None = None  # structured outputs (epdserve.frontend.structured)
    regex: str | None = None
    ebnf: str | None = None

    def stop_list(self) -> list[str]:
        return stop_list(self.stop)


class GenerateRequest(BaseModel):
    """One SGLang ``/generate`` request: exactly one of ``text`` (tokenized as is, no chat template) and
    ``input_ids``. ``stream`` answers with SSE events carrying the text and ids so far (SGLang's default)."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = Field(default=None, max_length=256)
    image_data: object | None = None
    return_logprob: bool = False
    structured_outputs: StructuredOutputs | None = None  # vLLM's (epdserve.frontend.structured)

    def unsupported(self) -> str | None:
        """A message naming the first problem or unimplemented feature of this request, else None."""
        if (self.text is None) == (self.input_ids is None):
            return "give exactly one of text and input_ids"
        if self.input_ids is not None and not self.input_ids:
            return "input_ids is empty"
        if self.image_data is not None:
            return "image_data is not supported on /generate; send images to /v1/chat/completions"
        if self.return_logprob:
            return "logprobs are not supported"
        sp = self.sampling_params
        if sp.min_p or sp.repetition_penalty != 1.0:
            return "min_p and repetition_penalty are not supported"
        if not sp.skip_special_tokens:
            return "skip_special_tokens=false is not supported"
        return None
