"""tokenmill: a self-hosted LLM serving engine built for goodput."""

__version__ = "0.1.0"

from tokenmill.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `tokenmill bench` and the core stay light.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
