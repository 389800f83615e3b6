// Loaded after RequireJS and before the widget manager (vendor/html-manager/embed-amd.js).

// The widget manager looks for its fonts beside the AMD module RequireJS loads it as; unconfigured,
// RequireJS places that module under the page's own folder (chapters/@jupyter-widgets/...), where
// nothing is. Point it at _static/html-manager.
require.config({
  paths: {"@jupyter-widgets/html-manager/dist": new URL("html-manager", document.currentScript.src).href},
});

// ipywidgets 8 typesets a widget's label with MathJax 2's call, MathJax.Hub.Queue(["Typeset",
// MathJax.Hub, element]); the site runs MathJax 3, which has no Hub, so each label threw a
// TypeError. MathJax 3 replaces the global MathJax object as it starts, so the Hub is put back
// on whatever object the global holds, and typesets through MathJax 3 once it has started.
(() => {
  const hub = {
    Queue(call) {
      const element = call[2];
      const mathjax = window.MathJax;
      if (mathjax && mathjax.startup && mathjax.startup.promise) {
        mathjax.startup.promise.then(() => mathjax.typesetPromise([element]));
      }
    },
  };
  let current = window.MathJax;
  Object.defineProperty(window, "MathJax", {
    configurable: true,
    get: () => current,
    set: (value) => {
      current = value;
      if (value && typeof value === "object" && !value.Hub) value.Hub = hub;
    },
  });
  window.MathJax = current;
})();
