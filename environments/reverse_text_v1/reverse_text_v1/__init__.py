"""reverse-text as a verifiers 0.4 taskset (`--env.taskset.id reverse-text-v1`)."""

from reverse_text_v1.taskset import ReverseTextTaskset

__all__ = ["ReverseTextTaskset"]
