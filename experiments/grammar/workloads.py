"""The workloads of the grammar bench (`experiments.grammar.bench`): a constraint each, and a
valid output to walk along it.

- `json_schema`: `INVOICE_SCHEMA`, an invoice extraction record (24 properties: nested parties
  and addresses through `$ref`, an array of line items, enums, patterns, `date` and `email`
  formats, length and item bounds, a nullable field), walked along `INVOICE` written compact;
- `regex`: `LOG_LINE_REGEX`, a timestamped log line, walked along `LOG_LINE`;
- `lark`: `SQL_GRAMMAR`, a small SELECT statement grammar (where the engine reads Lark), walked
  along `SQL_QUERY`.

Plain data: no engine, no tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

JSON_SCHEMA = "json_schema"
REGEX = "regex"
LARK = "lark"

INVOICE_SCHEMA = """{
  "title": "Invoice", "type": "object", "additionalProperties": false,
  "required": ["invoice_number", "issue_date", "status", "currency", "seller", "buyer",
               "line_items", "subtotal", "total", "paid", "notes", "tags"],
  "properties": {
    "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4}-[0-9]{5}$"},
    "issue_date": {"type": "string", "format": "date"},
    "status": {"type": "string", "enum": ["draft", "sent", "paid", "overdue", "void"]},
    "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
    "seller": {"$ref": "#/$defs/party"},
    "buyer": {"$ref": "#/$defs/party"},
    "line_items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {
      "type": "object", "additionalProperties": false,
      "required": ["sku", "description", "quantity", "unit_price", "tax_rate"],
      "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3,6}$"},
        "description": {"type": "string", "minLength": 1, "maxLength": 120},
        "quantity": {"type": "integer", "minimum": 1},
        "unit_price": {"type": "number", "minimum": 0},
        "tax_rate": {"type": "number", "minimum": 0, "maximum": 1}}}},
    "subtotal": {"type": "number"},
    "total": {"type": "number"},
    "paid": {"type": "boolean"},
    "notes": {"anyOf": [{"type": "string", "maxLength": 300}, {"type": "null"}]},
    "tags": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 20}}},
  "$defs": {
    "party": {
      "type": "object", "additionalProperties": false,
      "required": ["name", "email", "address"],
      "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 80},
        "email": {"type": "string", "format": "email"},
        "address": {
          "type": "object", "additionalProperties": false,
          "required": ["street", "city", "postal_code", "country"],
          "properties": {
            "street": {"type": "string", "maxLength": 100},
            "city": {"type": "string", "maxLength": 60},
            "postal_code": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
            "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}}}}}
}"""
"""An invoice extraction record, 24 properties (12 top-level, 5 per line item, 3 per party,
4 per address), as a client would send it."""

INVOICE = """{
  "invoice_number": "INV-2024-00731", "issue_date": "2024-03-18", "status": "sent",
  "currency": "EUR",
  "seller": {"name": "Nordlicht Software GmbH", "email": "billing@nordlicht.example",
             "address": {"street": "Friedrichstraße 123", "city": "Berlin",
                         "postal_code": "10117", "country": "DE"}},
  "buyer": {"name": "Acme Widgets Ltd.", "email": "ap@acme-widgets.example",
            "address": {"street": "42 Harbour Road", "city": "Bristol",
                        "postal_code": "BS1 5TR", "country": "GB"}},
  "line_items": [
    {"sku": "LIC-2031", "description": "Annual platform licence, 25 seats", "quantity": 1,
     "unit_price": 4800.0, "tax_rate": 0.19},
    {"sku": "SUP-110", "description": "Priority support (12 months)", "quantity": 1,
     "unit_price": 1200.0, "tax_rate": 0.19},
    {"sku": "TRN-4500", "description": "On-site training day", "quantity": 2,
     "unit_price": 950.5, "tax_rate": 0.19}],
  "subtotal": 7901.0, "total": 9402.19, "paid": false,
  "notes": "Payment within 30 days. Please quote the invoice number.",
  "tags": ["software", "annual", "q1"]
}"""
"""A valid instance of `INVOICE_SCHEMA`, its keys in the schema's order (walked compact)."""

LOG_LINE_REGEX = (
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]Z (DEBUG|INFO|WARN|ERROR) "
    r"[a-z][a-z0-9_.]{0,31}: [A-Za-z0-9 ,.'()-]{1,120}"
)
LOG_LINE = (
    "2024-03-18T09:41:07Z WARN tandem.scheduler: queue depth 17 above soft limit (16), "
    "shedding low-priority work."
)

SQL_GRAMMAR = r"""
start: query
query: "SELECT " columns " FROM " NAME where? order? limit? ";"
columns: "*" | NAME (", " NAME)*
where: " WHERE " condition (" AND " condition)*
condition: NAME " " OP " " value
value: NUMBER | STRING
order: " ORDER BY " NAME (" ASC" | " DESC")?
limit: " LIMIT " NUMBER
OP: "=" | "!=" | "<" | "<=" | ">" | ">="
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /[0-9]+/
STRING: /'[^'\n]*'/
"""
SQL_QUERY = (
    "SELECT id, name, total FROM invoices WHERE status = 'overdue' AND total > 1000 "
    "ORDER BY total DESC LIMIT 20;"
)


@dataclass(frozen=True)
class Workload:
    """A constraint (`source`: the schema as JSON text, the regex, the Lark grammar) and a
    valid output `text` to walk it along."""

    kind: str
    source: str
    text: str


WORKLOADS = {
    JSON_SCHEMA: Workload(
        JSON_SCHEMA,
        INVOICE_SCHEMA,
        json.dumps(json.loads(INVOICE), separators=(",", ":"), ensure_ascii=False),
    ),
    REGEX: Workload(REGEX, LOG_LINE_REGEX, LOG_LINE),
    LARK: Workload(LARK, SQL_GRAMMAR, SQL_QUERY),
}
