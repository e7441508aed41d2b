"""A checkpoint's chat template, rendered as Hugging Face transformers renders it.

The template is ``chat_template.jinja`` when the checkpoint has one, else ``chat_template`` of
``tokenizer_config.json`` (a string, or a list of named templates: ``default``, or ``tool_use``
when tools are given). It is compiled once, in jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, ``loopcontrols`` and ``{% generation %}`` blocks, the
``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter that does not escape HTML,
and the sandbox hardening transformers adds (``dict`` without attribute tricks, ``namespace``
refusing underscore names). Rendering passes ``messages``, ``tools``, ``documents`` (None),
``add_generation_prompt``, the special tokens of ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ...) and the caller's ``chat_template_kwargs``, as ``apply_chat_template`` does.
The text is then tokenized without adding special tokens (the template wrote them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

log = logging.getLogger(__name__)

#: The special tokens a template may name: ``bos_token`` and the like, ``additional_special_tokens``.
SpecialTokens = dict[str, str | list[str]]
#: What a template is given as the caller sent it (a message, a tool, a ``chat_template_kwargs``
#: value): JSON that only the template reads.
TemplateInput = Mapping[str, object]

#: The tokens of ``tokenizer_config.json`` a template may refer to by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(Exception):
    """The template could not be loaded, or could not render these messages."""


def _token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an ``AddedToken`` object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _compile(source: str) -> jinja2.Template:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body (it marks assistant text)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template (or several, by name) and the special tokens it may use."""

    def __init__(self, templates: dict[str, str], special_tokens: SpecialTokens, origin: str):
        self.origin = origin
        self.special_tokens = special_tokens
        self._sources = templates
        self._compiled: dict[str, jinja2.Template] = {}
        for name, source in templates.items():
            try:
                self._compiled[name] = _compile(source)
            except Exception as exc:
                raise ChatTemplateError(f"the chat template {name!r} of {origin} does not compile: {exc}") from None

    def _pick(self, has_tools: bool) -> jinja2.Template:
        if has_tools and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        names = ", ".join(sorted(self._compiled))
        raise ChatTemplateError(f"{self.origin} names chat templates ({names}) but none called 'default'")

    def render(
        self,
        messages: Sequence[TemplateInput],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[TemplateInput] | None = None,
        extra: TemplateInput | None = None,
    ) -> str:
        """The prompt text for ``messages``; :class:`ChatTemplateError` saying why when it cannot."""
        template = self._pick(bool(tools))
        kwargs = {**self.special_tokens, **(extra or {})}
        try:
            return str(
                template.render(
                    messages=messages,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
            )
        except Exception as exc:
            # raise_exception, sandbox refusals, and templates tripping over unusual messages alike.
            raise ChatTemplateError(f"the chat template could not render these messages: {exc}") from None


def _special_tokens(config: Mapping[str, object]) -> SpecialTokens:
    tokens: SpecialTokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            tokens[name] = text
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [t for t in (_token_text(v) for v in extra) if t is not None]
    return tokens


def _named(value: object, origin: str) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        named = {
            str(item["name"]): str(item["template"])
            for item in value
            if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        }
        if named:
            return named
    raise ChatTemplateError(f"chat_template in {origin} is neither a string nor a list of named templates")


def load_chat_template(model_path: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template; None when it has none. A template that is there but cannot be
    read or compiled raises :class:`ChatTemplateError`."""
    root = Path(model_path)
    config_file = root / "tokenizer_config.json"
    config: dict[str, object] = {}
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ChatTemplateError(f"{config_file} is not readable JSON: {exc}") from None
        if isinstance(loaded, dict):
            config = loaded
    special = _special_tokens(config)
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            source = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{jinja_file} is not readable: {exc}") from None
        return ChatTemplate({"default": source}, special, str(jinja_file))
    if config.get("chat_template") is None:
        return None
    return ChatTemplate(_named(config["chat_template"], str(config_file)), special, str(config_file))


class ChatTemplateSlot:
    """What a worker knows about its checkpoint's template: the template, or why there is none."""

    def __init__(self, model_path: str | Path):
        self.template: ChatTemplate | None = None
        self.problem: str | None = None
        try:
            self.template = load_chat_template(model_path)
        except ChatTemplateError as exc:
            self.problem = str(exc)
            log.warning("chat template unusable: %s", exc)
        if self.template is None and self.problem is None:
            self.problem = (
                f"the model at {model_path} has no chat template (neither chat_template.jinja nor chat_template in "
                "tokenizer_config.json); use /v1/completions with a prompt you format yourself"
            )

    def require(self) -> ChatTemplate:
        if self.template is None:
            raise ChatTemplateError(self.problem or "no chat template")
        return self.template
