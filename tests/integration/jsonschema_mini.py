"""A small JSON Schema (draft 2020-12) validator, standard library only.

Enough for proto/schema/: type, enum, const, pattern, required, properties,
patternProperties, additionalProperties, propertyNames, minProperties, maxProperties,
items, prefixItems, contains, minItems, maxItems, minLength, maxLength, minimum, maximum,
oneOf, anyOf, allOf, not, if/then/else, and $ref to local $defs or to other schema files
(by $id or by file name). A keyword it does not know is an error, so a schema can never
silently check less than it says. Annotation keywords ($schema, $id, title, ...) are
ignored.

Patterns are Python regular expressions searched anywhere in the string (as ECMA-262
patterns are); keep schema patterns to the syntax both dialects share.

Validator.validate(instance, schema_name) returns a list of error strings (empty when
valid). An instance equal to WILDCARD is valid against every schema: transcripts use it
for the values their patterns leave open ("$ANY").
"""
import json
import os
import re
import urllib.parse

__all__ = ["Validator", "SchemaError", "WILDCARD", "json_equal"]


class SchemaError(Exception):
    """The schema itself is broken or uses a keyword outside the subset."""


class _Wildcard:
    def __repr__(self):
        return "WILDCARD"


WILDCARD = _Wildcard()

_ANNOTATIONS = {
    "$schema", "$id", "$defs", "$comment", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "format",
}
_APPLICATORS = {
    "type", "enum", "const", "pattern", "required", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "minProperties", "maxProperties", "items",
    "prefixItems", "contains", "minItems", "maxItems", "minLength", "maxLength", "minimum",
    "maximum", "oneOf", "anyOf", "allOf", "not", "if", "then", "else", "$ref",
}


def _type_of(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    raise TypeError("not a JSON value: %r" % (v,))


def _is_type(v, t):
    actual = _type_of(v)
    if t == actual:
        return True
    if t == "number" and actual == "integer":
        return True
    if t == "integer" and actual == "number":
        return v == v and v not in (float("inf"), float("-inf")) and float(v).is_integer()
    return False


def json_equal(a, b):
    """Equality of JSON values: true is not 1, 1 equals 1.0, objects ignore key order."""
    ta, tb = _type_of(a), _type_of(b)
    if {ta, tb} <= {"integer", "number"}:
        return a == b
    if ta != tb:
        return False
    if ta == "array":
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if ta == "object":
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return a == b


def _pointer_get(doc, fragment, where):
    if fragment == "":
        return doc
    if not fragment.startswith("/"):
        raise SchemaError("%s: only JSON-pointer fragments are supported: #%s" % (where, fragment))
    cur = doc
    for raw in fragment[1:].split("/"):
        part = urllib.parse.unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(cur, list):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise SchemaError("%s: unresolvable $ref fragment #%s" % (where, fragment))
    return cur


class Validator:
    def __init__(self, schema_dir):
        """Loads every *.json file of schema_dir; they may $ref each other."""
        self.by_uri = {}
        self.by_name = {}
        for name in sorted(os.listdir(schema_dir)):
            if not name.endswith(".json"):
                continue
            with open(os.path.join(schema_dir, name), encoding="utf-8") as f:
                doc = json.load(f)
            base = doc.get("$id", name) if isinstance(doc, dict) else name
            self.by_name[name] = (base, doc)
            self.by_uri[base] = doc
        self._regex = {}

    def names(self):
        return sorted(self.by_name)

    def validate(self, instance, name):
        """Errors of instance against the schema file `name` ("message-map.schema.json")."""
        if name not in self.by_name:
            raise SchemaError("no schema file %s" % name)
        base, doc = self.by_name[name]
        errors = []
        self._check(instance, doc, base, "$", errors)
        return errors

    def is_valid(self, instance, name):
        return not self.validate(instance, name)

    def check_schemas(self):
        """Walks every schema once, resolving each $ref and compiling each pattern, so a
        broken schema fails even where no instance reaches it. Returns a list of problems."""
        problems = []
        for name, (base, doc) in sorted(self.by_name.items()):
            try:
                self._walk_schema(doc, base, name)
            except (SchemaError, re.error) as e:
                problems.append("%s: %s" % (name, e))
        return problems

    def _walk_schema(self, s, base, where):
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            raise SchemaError("%s: a schema must be an object or a boolean" % where)
        for k, v in s.items():
            if k not in _ANNOTATIONS and k not in _APPLICATORS:
                raise SchemaError("%s: unsupported keyword %s" % (where, k))
        if "$ref" in s:
            self._resolve(s["$ref"], base, where)
        if "pattern" in s:
            self._compile(s["pattern"])
        for k in ("properties", "patternProperties", "$defs"):
            for sub_name, sub in s.get(k, {}).items():
                if k == "patternProperties":
                    self._compile(sub_name)
                self._walk_schema(sub, base, where + "/" + k + "/" + sub_name)
        for k in ("additionalProperties", "propertyNames", "items", "contains", "not", "if",
                  "then", "else"):
            if k in s:
                self._walk_schema(s[k], base, where + "/" + k)
        for k in ("prefixItems", "oneOf", "anyOf", "allOf"):
            for i, sub in enumerate(s.get(k, [])):
                self._walk_schema(sub, base, "%s/%s/%d" % (where, k, i))

    def _compile(self, pattern):
        r = self._regex.get(pattern)
        if r is None:
            r = re.compile(pattern)
            self._regex[pattern] = r
        return r

    def _resolve(self, ref, base, where):
        uri, _, fragment = ref.partition("#")
        if uri:
            target_uri = urllib.parse.urljoin(base, uri)
            doc = self.by_uri.get(target_uri)
            if doc is None:
                tail = target_uri.rsplit("/", 1)[-1]
                if tail in self.by_name:
                    target_uri, doc = self.by_name[tail]
            if doc is None:
                raise SchemaError("%s: unresolvable $ref %s" % (where, ref))
        else:
            target_uri = base
            doc = self.by_uri.get(base)
            if doc is None:
                raise SchemaError("%s: no document for base %s" % (where, base))
        return target_uri, _pointer_get(doc, urllib.parse.unquote(fragment), where)

    def _check(self, v, s, base, path, errors):
        if v is WILDCARD or s is True:
            return
        if s is False:
            errors.append("%s: no value is allowed here" % path)
            return
        if not isinstance(s, dict):
            raise SchemaError("%s: a schema must be an object or a boolean" % path)
        for k in s:
            if k not in _ANNOTATIONS and k not in _APPLICATORS:
                raise SchemaError("%s: unsupported keyword %s" % (path, k))
        if "$ref" in s:
            tbase, target = self._resolve(s["$ref"], base, path)
            self._check(v, target, tbase, path, errors)

        if "type" in s:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            if not any(_is_type(v, t) for t in types):
                errors.append("%s: expected %s, got %s" % (path, "/".join(types), _type_of(v)))
                return
        if "enum" in s and not any(json_equal(v, e) for e in s["enum"]):
            errors.append("%s: %s is not one of %s" % (path, json.dumps(v), json.dumps(s["enum"])))
        if "const" in s and not json_equal(v, s["const"]):
            errors.append("%s: expected %s, got %s" % (path, json.dumps(s["const"]), json.dumps(v)))

        if isinstance(v, str):
            if "minLength" in s and len(v) < s["minLength"]:
                errors.append("%s: shorter than %d characters" % (path, s["minLength"]))
            if "maxLength" in s and len(v) > s["maxLength"]:
                errors.append("%s: longer than %d characters" % (path, s["maxLength"]))
            if "pattern" in s and not self._compile(s["pattern"]).search(v):
                errors.append("%s: %s does not match /%s/" % (path, json.dumps(v), s["pattern"]))

        if _type_of(v) in ("integer", "number"):
            if "minimum" in s and v < s["minimum"]:
                errors.append("%s: %s is below the minimum %s" % (path, v, s["minimum"]))
            if "maximum" in s and v > s["maximum"]:
                errors.append("%s: %s is above the maximum %s" % (path, v, s["maximum"]))

        if isinstance(v, dict):
            self._check_object(v, s, base, path, errors)
        if isinstance(v, list):
            self._check_array(v, s, base, path, errors)

        if "allOf" in s:
            for sub in s["allOf"]:
                self._check(v, sub, base, path, errors)
        if "anyOf" in s:
            if not any(self._valid(v, sub, base, path) for sub in s["anyOf"]):
                errors.append("%s: matches none of anyOf%s" % (path, self._why(v, s["anyOf"], base, path)))
        if "oneOf" in s:
            n = sum(1 for sub in s["oneOf"] if self._valid(v, sub, base, path))
            if n != 1:
                errors.append("%s: matches %d of oneOf, expected exactly 1%s" %
                              (path, n, self._why(v, s["oneOf"], base, path) if n == 0 else ""))
        if "not" in s and self._valid(v, s["not"], base, path):
            errors.append("%s: matches a schema it must not match (%s)" % (path, json.dumps(s["not"])))
        if "if" in s:
            if self._valid(v, s["if"], base, path):
                if "then" in s:
                    self._check(v, s["then"], base, path, errors)
            elif "else" in s:
                self._check(v, s["else"], base, path, errors)

    def _check_object(self, v, s, base, path, errors):
        for k in s.get("required", []):
            if k not in v:
                errors.append("%s: missing required key %s" % (path, json.dumps(k)))
        if "minProperties" in s and len(v) < s["minProperties"]:
            errors.append("%s: fewer than %d keys" % (path, s["minProperties"]))
        if "maxProperties" in s and len(v) > s["maxProperties"]:
            errors.append("%s: more than %d keys" % (path, s["maxProperties"]))
        props = s.get("properties", {})
        pprops = s.get("patternProperties", {})
        for k, item in v.items():
            sub = "%s.%s" % (path, k)
            if "propertyNames" in s:
                self._check(k, s["propertyNames"], base, sub + " (key)", errors)
            matched = False
            if k in props:
                matched = True
                self._check(item, props[k], base, sub, errors)
            for pat, psch in pprops.items():
                if self._compile(pat).search(k):
                    matched = True
                    self._check(item, psch, base, sub, errors)
            if not matched and "additionalProperties" in s:
                if s["additionalProperties"] is False:
                    errors.append("%s: unexpected key %s" % (path, json.dumps(k)))
                else:
                    self._check(item, s["additionalProperties"], base, sub, errors)

    def _check_array(self, v, s, base, path, errors):
        if "minItems" in s and len(v) < s["minItems"]:
            errors.append("%s: fewer than %d items" % (path, s["minItems"]))
        if "maxItems" in s and len(v) > s["maxItems"]:
            errors.append("%s: more than %d items" % (path, s["maxItems"]))
        prefix = s.get("prefixItems", [])
        for i, item in enumerate(v):
            sub = "%s[%d]" % (path, i)
            if i < len(prefix):
                self._check(item, prefix[i], base, sub, errors)
            elif "items" in s:
                if s["items"] is False:
                    errors.append("%s: no item is allowed past %d" % (path, len(prefix)))
                else:
                    self._check(item, s["items"], base, sub, errors)
        if "contains" in s and not any(self._valid(item, s["contains"], base, path) for item in v):
            errors.append("%s: no item matches contains" % path)

    def _valid(self, v, s, base, path):
        e = []
        self._check(v, s, base, path, e)
        return not e

    def _why(self, v, subs, base, path):
        parts = []
        for i, sub in enumerate(subs):
            e = []
            self._check(v, sub, base, path, e)
            parts.append("[%d] %s" % (i, "; ".join(e[:3])))
        return " (" + " | ".join(parts) + ")"
