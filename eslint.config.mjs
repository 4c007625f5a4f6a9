// ESLint's flat config for the JavaScript the package ships and the JavaScript that tests it (.ci/run runs
// `npx eslint .`): ESLint's recommended rules, with the globals of where each file runs.
import js from '@eslint/js';
import globals from 'globals';

export default [
  {ignores: ['node_modules/', 'site/', 'runs/', '.venv/']},
  js.configs.recommended,
  {
    // Shipped: the device runner and the fleet's device protocol run in a page and in Node (which has the
    // browser globals they use: fetch, performance, TextEncoder, URL).
    files: ['ort_lightning/**/*.js'],
    languageOptions: {ecmaVersion: 2025, sourceType: 'module', globals: {...globals.browser}},
  },
  {
    // Shipped for Node: the fleet's Node devices.
    files: ['ort_lightning/**/*.mjs'],
    languageOptions: {ecmaVersion: 2025, sourceType: 'module', globals: {...globals.node}},
  },
  {
    files: ['examples/**/*.js'],
    languageOptions: {ecmaVersion: 2025, sourceType: 'module', globals: {...globals.browser}},
  },
  {
    files: ['tests/**/*.mjs', 'tests/**/*.js', 'benchmarks/**/*.mjs', 'tools/**/*.mjs', 'eslint.config.mjs'],
    languageOptions: {ecmaVersion: 2025, sourceType: 'module', globals: {...globals.node}},
  },
];
