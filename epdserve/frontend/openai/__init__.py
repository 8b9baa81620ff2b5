"""OpenAI's API: chat completions (:mod:`.chat`, with tools and structured outputs), the legacy completions
(:mod:`.completions`) and the model list, as one router (:mod:`.routes`)."""
