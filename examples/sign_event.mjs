// A lifecycle-event signer written from docs/lifecycle.md ("The signed form") alone:
// Ed25519 over  "loraplane.lifecycle.v1\n" + canonical JSON of the event without "signature".
//
//   node examples/sign_event.mjs KEY_SEED_B64 PUBLISHER KEY_ID < event.json > signed.json
//
// event.json: the event's fields; absent optional fields get their defaults here, because
// the signed form always has every field. Needs only node (>= 16) and its crypto module.
import { createPrivateKey, sign } from "node:crypto";
import { readFileSync } from "node:fs";

const DOMAIN = "loraplane.lifecycle.v1";
// Fields whose schema type is "number" (a float): written the way Python writes floats.
const FLOAT_PATHS = new Set(["canary_percent", "record.release.canary_percent"]);

function withDefaults(event) {
  const e = { schema_version: 1, record: null, canary_percent: null, rollback_to: null,
              reason: "", ...event };
  delete e.signature;
  if (e.record !== null) {
    const r = { schema_version: 1, format: "peft", status: "published", priority: "silver",
                ...e.record };
    r.compatibility = { tokenizer_revision: "", ...r.compatibility };
    r.release = { canary_percent: 0.0, rollback_to: null, ...(r.release || {}) };
    e.record = r;
  }
  return e;
}

// Python's repr of a finite float: shortest round-trip digits (as JavaScript finds them),
// ".0" after a whole number, exponent form (e-05, e+16) outside [1e-4, 1e16).
export function pyFloat(x) {
  if (!Number.isFinite(x)) throw new Error("NaN and Infinity are not JSON");
  if (Object.is(x, -0)) return "-0.0";
  if (x === 0) return "0.0";
  const ax = Math.abs(x);
  if (ax >= 1e-4 && ax < 1e16) {
    const s = String(x);  // positional in this range, shortest digits
    return /[.e]/.test(s) ? s : s + ".0";
  }
  const [mant, exp] = x.toExponential().split("e");  // shortest digits
  const n = Number(exp);
  const e = (n < 0 ? "-" : "+") + String(Math.abs(n)).padStart(2, "0");
  return mant + "e" + e;
}

function canonical(value, path) {
  if (value === null) return "null";
  if (typeof value === "boolean") return value ? "true" : "false";
  if (typeof value === "number") {
    if (FLOAT_PATHS.has(path)) return pyFloat(value);
    if (!Number.isSafeInteger(value)) throw new Error(`${path}: not a safe integer`);
    return String(value);
  }
  if (typeof value === "string") return JSON.stringify(value);  // same escapes as Python's
  if (Array.isArray(value)) return "[" + value.map((v) => canonical(v, path + "[]")).join(",") + "]";
  const keys = Object.keys(value).sort();  // ASCII field names: code-unit order = code points
  return "{" + keys.map((k) => JSON.stringify(k) + ":" +
    canonical(value[k], path ? `${path}.${k}` : k)).join(",") + "}";
}

export function signedBytes(event) {
  return Buffer.from(DOMAIN + "\n" + canonical(withDefaults(event), ""), "utf8");
}

export function signEvent(event, seedB64, publisher, keyId) {
  const seed = Buffer.from(seedB64, "base64");
  if (seed.length !== 32) throw new Error("the key seed is 32 bytes");
  const der = Buffer.concat([Buffer.from("302e020100300506032b657004220420", "hex"), seed]);
  const key = createPrivateKey({ key: der, format: "der", type: "pkcs8" });
  const unsigned = withDefaults({ ...event, publisher, key_id: keyId });
  const signature = sign(null, signedBytes(unsigned), key).toString("base64");
  return { ...unsigned, signature };
}

if (process.argv[1] && process.argv[1].endsWith("sign_event.mjs")) {
  const [seed, publisher, keyId] = process.argv.slice(2);
  const event = JSON.parse(readFileSync(0, "utf8"));
  process.stdout.write(JSON.stringify(signEvent(event, seed, publisher, keyId)) + "\n");
}
