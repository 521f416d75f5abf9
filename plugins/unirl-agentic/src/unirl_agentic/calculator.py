"""``calculator``: arithmetic on a whitelisted AST. No ``eval``; exponents and result sizes are bounded,
so ``9**9**9`` or ``10**10**6`` is refused before any big number is built."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from unirl.api import Tool, ToolResult
from unirl_agentic.options import tool_options

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorOptions(BaseModel):
    """``plugins.agentic.tools.calculator``."""

    model_config = ConfigDict(extra="forbid")

    max_chars: int = Field(200, ge=1, description="longest expression accepted")
    max_exponent: int = Field(64, ge=1, description="largest |exponent| of **")
    max_digits: int = Field(100, ge=1, description="largest integer result, in decimal digits")


class CalcError(ValueError):
    pass


class Calculator(Tool):
    """``{"expression": "347*29"}`` -> ``"10063"``. Integers stay exact; ``/`` gives a float."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    Config = CalculatorOptions

    def __init__(self, *, config: Any = None, options: CalculatorOptions | dict | None = None):
        if options is None and config is not None:
            options = tool_options(config, self.name)
        self.options = options if isinstance(options, CalculatorOptions) else CalculatorOptions.model_validate(
            options or {})

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            return ToolResult('calculator: arguments must be {"expression": "<arithmetic>"}', error=True)
        try:
            return ToolResult(_format(self.evaluate(expr)))
        except CalcError as exc:
            return ToolResult(f"calculator: {exc}", error=True)
        except (ValueError, TypeError, ArithmeticError, RecursionError, MemoryError, UnicodeError) as exc:
            # anything else it cannot evaluate (lone surrogates, NUL bytes, deep nesting, huge floats) is a
            # bad call the model should see, never an exception that becomes a NaN reward
            return ToolResult(f"calculator: cannot evaluate this expression ({type(exc).__name__})", error=True)

    def evaluate(self, expr: str) -> int | float:
        if len(expr) > self.options.max_chars:
            raise CalcError(f"expression longer than {self.options.max_chars} characters")
        try:
            tree = ast.parse(expr.strip(), mode="eval")
        except (SyntaxError, ValueError, UnicodeError, RecursionError, MemoryError):
            raise CalcError(f"cannot parse {expr!r}") from None
        return self._eval(tree.body)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            a, b = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_pow(a, b)
            try:
                return self._check(_BIN[type(node.op)](a, b))
            except ZeroDivisionError:
                raise CalcError("division by zero") from None
            except OverflowError:
                raise CalcError("result too large") from None
        raise CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")

    def _check_pow(self, base: int | float, exp: int | float) -> None:
        if abs(exp) > self.options.max_exponent:
            raise CalcError(f"exponent {exp} exceeds {self.options.max_exponent}")
        if isinstance(base, int) and isinstance(exp, int) and exp > 0 and base not in (0, 1, -1):
            digits = len(str(abs(base)))
            if (digits - 1) * exp >= self.options.max_digits:
                raise CalcError(f"result would exceed {self.options.max_digits} digits")

    def _check(self, value: int | float) -> int | float:
        if isinstance(value, complex):
            raise CalcError("complex result")
        if isinstance(value, int) and abs(value) >= 10 ** self.options.max_digits:
            raise CalcError(f"result exceeds {self.options.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalcError("result is not finite")
        return value


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)
