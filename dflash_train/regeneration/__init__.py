"""The target rewrites the answers: prompts -> chats whose responses the target itself wrote.

    regenerate      the resumable, rank-split regeneration of a corpus (``dflash-train regenerate``)
    turns           multi-turn regeneration, one user turn per round
    backends        the target in this process, or an OpenAI-compatible server
    generation      the runtime without a drafter (and Hugging Face ``generate`` for other architectures)
    self_prompts    prompts written by the target itself (``dflash-train self-prompt``)
"""
