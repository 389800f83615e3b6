// The widget manager (vendor/html-manager/embed-amd.js) looks for its fonts beside the AMD module
// RequireJS loads it as; unconfigured, RequireJS places that module under the page's own folder
// (chapters/@jupyter-widgets/html-manager/dist/), where nothing is. Point it at _static/html-manager.
require.config({
  paths: {"@jupyter-widgets/html-manager/dist": new URL("html-manager", document.currentScript.src).href},
});
