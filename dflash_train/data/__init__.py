"""Tokenisation and loss masks: chat data -> token ids with the tokens the drafter is trained on.

    chat               render conversations with the target's template and mark the supervised tokens
    prepare            corpora -> a prepared dataset (``dflash-train prepare``)
    prepared           the prepared dataset on disk
    prompt_ids         a conversation -> the prompt ids and stop tokens the target answers from
    target_tokenizer   the target's tokenizer, without its weights
    loop_trim          answers that end in a verbatim loop, cut (``prepare --trim-loops``)

    from dflash_train.data import load_prepared
"""

from dflash_train.data.prepared import load_prepared

__all__ = ["load_prepared"]
