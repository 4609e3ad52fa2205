// llama.cpp on a GGUF, for the README's side-by-side figures: the prefill of a text file's tokens (no chat
// template), then N_DECODE greedy tokens; one JSON line on stdout. llama.cpp comes as node-llama-cpp's prebuilt
// CPU build (npm; PyPI has no llama-cpp-python wheel for this machine), f16 KV cache, batch 512:
//
//   mkdir -p /tmp/llcpp && cd /tmp/llcpp && npm install node-llama-cpp@3.22.1 && cp REPO/scripts/llama_cpp_bench.mjs .
//   /usr/bin/time -v node llama_cpp_bench.mjs MODEL.gguf TEXT_FILE N_DECODE THREADS
//
// (run from the folder npm installed into: an ES module resolves node-llama-cpp from its own location)
import {getLlama} from "node-llama-cpp";
import {readFileSync} from "node:fs";
const [model_path, text_path, n_decode, threads] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", maxThreads: Number(threads)});
const model = await llama.loadModel({modelPath: model_path, gpuLayers: 0});
const tokens = model.tokenize(readFileSync(text_path, "utf8"));
const context = await model.createContext({contextSize: tokens.length + Number(n_decode) + 16, batchSize: 512,
                                           threads: {ideal: Number(threads), min: Number(threads)}});
const seq = context.getSequence();
const t0 = performance.now();
await seq.evaluateWithoutGeneratingNewTokens(tokens.slice(0, -1));
const t1 = performance.now();
let n = 0, first = null;
for await (const tok of seq.evaluate(tokens.slice(-1), {temperature: 0})) {
    n += 1;
    if (n === 1) first = performance.now();
    if (n >= Number(n_decode)) break;
}
const t2 = performance.now();
console.log(JSON.stringify({build: llama.buildType, prompt_tokens: tokens.length,
    prefill_s: (t1 - t0) / 1000, prefill_tok_s: (tokens.length - 1) / ((t1 - t0) / 1000),
    decode_tokens: n - 1, decode_ms_per_token: (t2 - first) / Math.max(1, n - 1),
    threads: Number(threads), kv: "f16 (llama.cpp default)"}));
