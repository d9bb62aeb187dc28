"""A byte-level BPE tokenizer trained locally for the tiny model (no model hub)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True, slots=True)
class SpecialToken:
    id: int
    text: str


BOS = SpecialToken(0, "<｜begin▁of▁sentence｜>")
EOS = SpecialToken(1, "<｜end▁of▁sentence｜>")
PAD = SpecialToken(2, "<｜pad｜>")
SPECIAL_TOKENS = (BOS, EOS, PAD)
# DeepSeek-V3's tool-call tokens, as in its tokenizer: added tokens that are not
# "special" (decoding keeps them), so vLLM's deepseek_v3 tool parser finds them
# in the output text as it does on a released checkpoint.
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_TOKENS = (
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
)
# Ids 0 .. NUM_RESERVED - 1: the special and the tool tokens.
NUM_RESERVED = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)

# DeepSeek-V2-Chat's layout: "User: ...\n\nAssistant: ...<eos>", system text first.
# With tools, DeepSeek-V3's: the tools listed after the system text, an
# assistant's calls in tool-call tokens (arguments as a ```json block), and tool
# results in tool-output tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages if message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}"
    "{% endfor %}"
    "{% if tools %}"
    "{{ '## Tools\\nYou have access to the following tools:\\n' }}"
    "{% for tool in tools %}"
    "{{ '\\n### ' + tool['function']['name'] + '\\nDescription: ' }}"
    "{{ tool['function'].get('description') or '' }}"
    "{{ '\\n\\nParameters: ' + (tool['function'].get('parameters') or {}) | tojson }}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{{ '\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n' }}"
    "{{ '" + TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "' }}"
    "{{ 'tool_call_name\\n```json\\ntool_call_arguments\\n```' }}"
    "{{ '" + TOOL_CALL_END + TOOL_CALLS_END + "\\n\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + (message['content'] or '') }}"
    "{% if message.get('tool_calls') %}"
    "{{ '" + TOOL_CALLS_BEGIN + "' }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '" + TOOL_CALL_BEGIN + "' + call['type'] + '" + TOOL_SEP + "' }}"
    "{{ call['function']['name'] + '\\n```json\\n' }}"
    "{{ call['function']['arguments'] + '\\n```" + TOOL_CALL_END + "' }}"
    "{% endfor %}"
    "{{ '" + TOOL_CALLS_END + "' }}"
    "{% endif %}"
    "{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '" + TOOL_OUTPUTS_BEGIN + TOOL_OUTPUT_BEGIN + "' + message['content'] }}"
    "{{ '" + TOOL_OUTPUT_END + TOOL_OUTPUTS_END + "\\n\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an "
    "model expert experts router token tokens cache page pages replica replicas "
    "request requests stream latency deadline queue priority realtime background "
    "normal serve serving cluster node nodes ray engine vllm deepseek mixture "
    "attention latent prefix hello world user assistant system you we they what "
    "how why when where which who can will would should could may might must data "
    "time first last next fast slow large small more less one two three four five"
).split()


def _corpus() -> list[str]:
    # Deterministic text covering words, digits, punctuation and whitespace shapes.
    lines = []
    n = len(_WORDS)
    for i in range(4000):
        words = [_WORDS[(i * 7 + j * 13 + (i // n)) % n] for j in range(3 + i % 9)]
        line = " ".join(words)
        if i % 5 == 0:
            line = line.capitalize() + f" {i}."
        elif i % 7 == 0:
            line += f", {i % 97}: {words[0]}?"
        lines.append(line)
    return lines


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains the byte-level BPE; the same vocab_size always gives the same result."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[t.text for t in SPECIAL_TOKENS] + list(TOOL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # The trainer makes every reserved token special; the tool tokens are not.
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS]
    )
    # BOS before every text encoded with special tokens, as DeepSeek's tokenizers
    # do (add_bos_token): what vLLM's completions and the ingress send the engine.
    # Chat templates write their own and are encoded without special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS.text} $A",
        pair=f"{BOS.text} $A {BOS.text} $B:1",
        special_tokens=[(BOS.text, BOS.id)],
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS.text,
        eos_token=EOS.text,
        pad_token=PAD.text,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
