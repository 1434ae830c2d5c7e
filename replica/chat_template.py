"""Chat templating: a conversation's prompt token ids, and which template renders it.

Shared by the offline API, the batch job and the ingress; it needs a tokenizer and
Jinja, never torch, so that the ingress imports it without the engine. The templates
that ship with kvserve are the .jinja files in chat_templates/ beside this module."""

from pathlib import Path

import jinja2

Message = dict[str, str]

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"

# The bundled SmolLM2's own template renders no tools; this one renders the same chats,
# and tools too, so the default model serves tool calls with no flag.
BUNDLED_CHAT_TEMPLATE = "chatml_tools"


def default_chat_template(model: str | None, chat_template: str | None) -> str | None:
    """The chat template asked for; else, for the bundled model (model None), one that renders tools."""
    if chat_template is None and model is None:
        return BUNDLED_CHAT_TEMPLATE
    return chat_template


def load_chat_template(template: str | None) -> str | None:
    """A Jinja template's text from: the name of one that ships with kvserve
    (`chatml_tools`), a file's path, or the text itself."""
    if template is None or "{" in template:
        return template
    bundled = TEMPLATES / f"{template}.jinja"
    path = bundled if bundled.is_file() else Path(template)
    if not path.is_file():
        names = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
        raise ValueError(f"chat template {template!r} is neither a file nor one of kvserve's: {names}")
    return path.read_text()


def chat_prompt_ids(
    tokenizer,
    messages: list[Message],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """The prompt token ids for a conversation, by default ready for the assistant's turn.
    tools: OpenAI tool definitions, for templates that render them. chat_template: a
    Jinja template to use instead of the model's. A template that refuses the messages
    (strict role alternation, an unknown role) raises ValueError with its reason."""
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise ValueError("this model has no chat template; use a plain prompt")
    if tools and "tools" not in template:
        raise ValueError(
            "this model's chat template does not render tools; serve it with a chat template that does"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template refused these messages: {e}") from None
    return tokenizer(text, add_special_tokens=False).input_ids
