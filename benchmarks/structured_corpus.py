"""Structured outputs on a corpus of real-world schemas, greedy on the embedded SmolLM2.

For each schema: is it accepted (compiled) or refused with a 400; if accepted, does greedy decoding under
the grammar stop (and does what stopped validate against the schema as written) or run to max_tokens.
The schemas are shaped like those clients send: OpenAI / Instructor / LangChain function parameters and
Pydantic models, JSON Schema Store fragments, OpenAPI request bodies. The targets (issue: structured
outputs): every output that stops validates, >= 90% accepted, < 10% of accepted ones end at max_tokens.

    PYTHONPATH=$PWD python benchmarks/structured_corpus.py [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import re
import tempfile
import time

import jsonschema

from kiln.config import DataSettings, Settings
from kiln.core.output_grammar import json_schema_grammar
from kiln.core.sampling import SamplingParams
from kiln.engine.actor import GenerationRequest
from kiln.engine.build import build_engine
from kiln.errors import KilnError
from kiln.model import kernels

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                            "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                                            "country": {"type": "string", "minLength": 2, "maxLength": 2}},
           "required": ["street", "city", "country"]}

CORPUS: list[tuple[str, str, dict]] = [
    ("weather_args", "Get the weather in Paris in celsius.",
     {"type": "object", "properties": {"location": {"type": "string", "description": "City and country"},
                                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
      "required": ["location", "unit"], "additionalProperties": False}),
    ("user_profile", "Create a user profile for Ada Lovelace, age 36, email ada@example.com.",
     {"title": "User", "type": "object", "properties": {
         "name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"},
         "email": {"title": "Email", "type": "string", "format": "email"}}, "required": ["name", "age", "email"]}),
    ("contact_form", "Fill a contact form for Bob at bob@mail.org asking about pricing.",
     {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                       "subject": {"type": "string", "maxLength": 80},
                                       "message": {"type": "string"}}, "required": ["email", "subject", "message"]}),
    ("calendar_event", "Schedule a team meeting on 2024-05-01 at 10:00 with Alice and Bob.",
     {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string", "format": "date"},
                                       "start_time": {"type": "string", "format": "time"},
                                       "attendees": {"type": "array", "items": {"type": "string"}}},
      "required": ["title", "date", "attendees"]}),
    ("invoice_line", "An invoice line: 3 widgets at 4.50 each.",
     {"type": "object", "properties": {"description": {"type": "string"},
                                       "quantity": {"type": "integer", "minimum": 1},
                                       "unit_price": {"type": "number", "minimum": 0},
                                       "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]}},
      "required": ["description", "quantity", "unit_price", "currency"]}),
    ("pagination", "Request page 2 of the results, 25 per page.",
     {"type": "object", "properties": {"page": {"type": "integer", "minimum": 1},
                                       "per_page": {"type": "integer", "multipleOf": 5, "minimum": 5}},
      "required": ["page", "per_page"]}),
    ("sentiment", "Classify the sentiment of: 'I love this phone'.",
     {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["label", "confidence"]}),
    ("entities", "Extract the people and places from: 'Marie Curie lived in Paris.'",
     {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "string"}},
                                       "places": {"type": "array", "items": {"type": "string"}}},
      "required": ["people", "places"]}),
    ("order_with_address", "An order of two books shipped to 1 Main St, Springfield, US.",
     {"type": "object", "properties": {"order_id": {"type": "string", "format": "uuid"},
                                       "items": {"type": "array", "minItems": 1, "items": {
                                           "type": "object", "properties": {"sku": {"type": "string"},
                                                                            "qty": {"type": "integer", "minimum": 1}},
                                           "required": ["sku", "qty"]}},
                                       "shipping": {"$ref": "#/$defs/address"}},
      "required": ["items", "shipping"], "$defs": {"address": ADDRESS}}),
    ("search_query", "Search for Italian restaurants near me, at most 5 results.",
     {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "maximum": 50},
                                       "filters": {"type": "object", "additionalProperties": {"type": "string"}}},
      "required": ["query"]}),
    ("tags_unique", "Give three unique tags for a blog post about Python testing.",
     {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                                                "maxItems": 5}}, "required": ["tags"]}),
    ("shape_union", "Describe a circle of radius 2.",
     {"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
                 "required": ["kind", "radius"]},
                {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                 "required": ["kind", "side"]}]}),
    ("pet_discriminated", "A pet: a dog named Rex that barks loudly.",
     {"oneOf": [{"type": "object", "properties": {"pet_type": {"const": "dog"}, "name": {"type": "string"},
                                                  "barks": {"type": "boolean"}}, "required": ["pet_type", "name"]},
                {"type": "object", "properties": {"pet_type": {"const": "cat"}, "name": {"type": "string"},
                                                  "lives": {"type": "integer", "maximum": 9}},
                 "required": ["pet_type", "name"]}]}),
    ("package_json", "A package.json for a library named left-pad version 1.3.0.",
     {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {
         "name": {"type": "string", "maxLength": 214, "pattern": "^[a-z0-9-~][a-z0-9-._~]*$"},
         "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
         "private": {"type": "boolean"}, "license": {"type": "string"},
         "dependencies": {"type": "object", "additionalProperties": {"type": "string"}}},
      "required": ["name", "version"]}),
    ("billing_dependent", "Payment details: a credit card 4111111111111111 with billing address 1 Main St.",
     {"type": "object", "properties": {"name": {"type": "string"}, "credit_card": {"type": "string"},
                                       "billing_address": {"type": "string"}},
      "required": ["name"], "dependentRequired": {"credit_card": ["billing_address"]}}),
    ("nullable_fields", "A product named Lamp; its price is unknown.",
     {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": ["number", "null"]},
                                       "sku": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
      "required": ["name", "price", "sku"]}),
    ("recipe", "A recipe for pancakes with three ingredients and two steps.",
     {"type": "object", "properties": {
         "title": {"type": "string"}, "servings": {"type": "integer", "minimum": 1, "maximum": 20},
         "ingredients": {"type": "array", "items": {"type": "object", "properties": {
             "item": {"type": "string"}, "amount": {"type": "string"}}, "required": ["item", "amount"]}},
         "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
      "required": ["title", "servings", "ingredients", "steps"]}),
    ("not_string_id", "An identifier for record 42 (a number, not text).",
     {"type": "object", "properties": {"id": {"not": {"type": "string"}}}, "required": ["id"]}),
    ("geo_point", "The coordinates of the Eiffel Tower.",
     {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                       "lon": {"type": "number", "minimum": -180, "maximum": 180}},
      "required": ["lat", "lon"]}),
    ("if_then_country", "An address in the United States with a postal code.",
     {"type": "object", "properties": {"country": {"enum": ["US", "CA"]}, "postal_code": {"type": "string"}},
      "required": ["country", "postal_code"],
      "if": {"properties": {"country": {"const": "US"}}},
      "then": {"properties": {"postal_code": {"pattern": "^[0-9]{5}$"}}}}),
]


def format_checker() -> jsonschema.FormatChecker:
    """Draft 2020-12's format checks, and RFC 3339 `time` (jsonschema checks it only with an optional
    package; its draft-independent checker would apply draft 3's `%H:%M:%S`)."""
    checker = jsonschema.FormatChecker(formats=list(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers))
    full_time = re.compile(r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)")
    checker.checks("time")(lambda value: not isinstance(value, str) or bool(full_time.fullmatch(value)))
    return checker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--compile-only", action="store_true", help="compile times only, no generation")
    args = ap.parse_args()
    root = pathlib.Path(tempfile.mkdtemp())
    eng = build_engine(Settings(data=DataSettings(data_dir=str(root / "d"))))
    print(f"isa {kernels.active_isa()}; {len(CORPUS)} schemas; greedy, max_tokens {args.max_tokens}")
    counts = {"accepted": 0, "refused": 0, "stop": 0, "length": 0, "valid": 0, "other": 0}
    assert eng.grammars.ll_tokenizer is not None   # built once, not part of a compile
    compile_ms: list[float] = []
    for name, ask, schema in CORPUS:
        try:
            g = eng.grammars.compile(json_schema_grammar(schema, kind="json_schema", param="schema"), code="bad")
        except KilnError as e:
            counts["refused"] += 1
            print(f"{name:20s} refused: {e.message[:110]}")
            continue
        counts["accepted"] += 1
        compile_ms.append(g.compile_ms)
        if args.compile_only:
            continue
        prompt = eng.encode_prompt(eng.render_chat([{"role": "user", "content": f"{ask} Answer in JSON."}]))
        params = eng.choice_params(SamplingParams(max_tokens=args.max_tokens, temperature=0.0), 1)

        async def go(request: GenerationRequest) -> tuple[list[int], str | None]:
            toks, finish = [], None
            async for _, ev in eng.submit([request]):
                toks += ev.token_ids
                finish = ev.finish_reason or finish
            return toks, finish

        t0 = time.perf_counter()
        toks, finish = asyncio.run(go(GenerationRequest(prompt, params, grammar=g)))
        text = eng.tokenizer.decode(toks, skip_special_tokens=True)
        verdict = ""
        if finish == "stop":
            counts["stop"] += 1
            try:
                jsonschema.Draft202012Validator(schema, format_checker=format_checker()).validate(json.loads(text))
                counts["valid"] += 1
                verdict = "valid"
            except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop
                verdict = f"INVALID ({str(e).splitlines()[0][:60]})"
        elif finish == "length":
            counts["length"] += 1
            verdict = f"... {text[-60:]!r}"
        else:
            counts["other"] += 1
        print(f"{name:20s} {finish:7s} {len(toks):4d} tok {time.perf_counter() - t0:5.1f}s {verdict} {text[:70]!r}")
    compile_ms.sort()
    print(f"compile ms: p50 {compile_ms[len(compile_ms) // 2]:.2f}, max {compile_ms[-1]:.2f}")
    n, acc = len(CORPUS), counts["accepted"]
    print(f"accepted {acc}/{n} ({acc / n:.0%}); stopped {counts['stop']}, of which valid {counts['valid']}; "
          f"ran to max_tokens {counts['length']}/{acc} ({counts['length'] / max(acc, 1):.0%}); other {counts['other']}")
    eng.shutdown()


if __name__ == "__main__":
    main()
